"""llama.cpp's own converter (convert_hf_to_gguf.py) run on a tiny model made by transformers: the text GGUF and, with
`--mmproj`, the multimodal projector GGUF, exactly as llama.cpp's users make them.

The converter comes from the llama-cpp-python sdist that benchmarks/build_llama_server.sh downloads into
benchmarks/.cache/sdist (or the llama.cpp tree named by LLAMA_CPP_SRC); without it the tests that need it skip.
One change is made to its run: the tiny models' word-level tokenizer is no pre-tokenizer llama.cpp knows by its
hash, so the converter is told it is SmolLM's (`smollm`, what SmolVLM's real tokenizer hashes to) instead of
refusing it; the vocabulary, the tensors and every other metadata key are the converter's own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_RUN = """
import sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def converter_source() -> Path | None:
    """The llama.cpp tree holding convert_hf_to_gguf.py, conversion/ and gguf-py/ (None: not here)."""
    env = os.environ.get("LLAMA_CPP_SRC")
    candidates = [Path(env)] if env else []
    for cache in (ROOT / "benchmarks/.cache/sdist", Path.home() / ".cache/lmserve/llama_cpp_src"):
        candidates += sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))
    for c in candidates:
        if (c / "convert_hf_to_gguf.py").is_file() and (c / "conversion").is_dir():
            return c
    tarballs = sorted((ROOT / "benchmarks/.cache/sdist").glob("llama_cpp_python-*.tar.gz"))
    if not tarballs:
        return None
    out = Path.home() / ".cache/lmserve/llama_cpp_src"  # only the converter's files, extracted once
    wanted = ("/vendor/llama.cpp/convert_hf_to_gguf.py", "/vendor/llama.cpp/conversion/", "/vendor/llama.cpp/gguf-py/")
    with tarfile.open(tarballs[-1]) as tar:
        tar.extractall(out, members=[m for m in tar.getmembers() if any(w in m.name for w in wanted)], filter="data")
    found = sorted(out.glob("llama_cpp_python-*/vendor/llama.cpp"))
    return found[-1] if found else None


def require_converter() -> Path:
    src = converter_source()
    if src is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not here (benchmarks/build_llama_server.sh downloads it)")
    return src


def convert(model_dir: Path, out_dir: Path, text_architecture: str = "VLlama3ForCausalLM",
            outtype: str = "f32", sentencepiece: bool = False) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) of a transformers vision-language model directory. `text_architecture` goes into a
    copy's text_config.architectures, where the released checkpoints have it (SmolVLM: VLlama3ForCausalLM) and the
    converter looks for it. `sentencepiece`: the copy gets the word-level vocabulary as a SentencePiece model
    (`write_sentencepiece`), so the text GGUF carries a tokenizer lmserve and llama.cpp both run."""
    src = require_converter()
    work = out_dir / (model_dir.name + "-convert")
    shutil.copytree(model_dir, work, dirs_exist_ok=True)
    cfg = json.loads((work / "config.json").read_text())
    cfg.setdefault("text_config", {})["architectures"] = [text_architecture]
    if sentencepiece:
        write_sentencepiece(work, int(cfg["text_config"]["vocab_size"]))
    (work / "config.json").write_text(json.dumps(cfg, indent=1))
    text, mmproj = out_dir / f"{model_dir.name}-{outtype}.gguf", out_dir / f"mmproj-{model_dir.name}-{outtype}.gguf"
    for extra, out in (([], text), (["--mmproj"], mmproj)):
        p = subprocess.run([sys.executable, "-c", _RUN, str(src), str(work), "--outtype", outtype, "--outfile",
                            str(out), *extra], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0 and out.is_file(), p.stderr[-3000:]
    return text, mmproj


def write_sentencepiece(path: Path, rows: int) -> None:
    """tokenizer.model: the directory's word-level vocabulary (tokenizer.json) as SentencePiece pieces at the same
    ids, so the converter writes a `llama` vocabulary (a word-level one has no merges, which a byte-level BPE GGUF
    needs). Words are spelled "\u2581w12" and the special tokens are control pieces; the pieces a word is merged from
    ("\u2581", "w", the digits, "\u2581w") take the rows after the vocabulary (`rows`: the model's, at least 13 more).
    A prompt of words and special tokens gets the word-level tokenizer's ids, plus a "\u2581" where a space is
    left alone before a special token."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    vocab = json.loads((path / "tokenizer.json").read_text())
    words = sorted(vocab["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in vocab.get("added_tokens", [])} | {"<s>", "</s>"}
    unk = vocab["model"].get("unk_token", "<pad>")
    extra = ["\u2581", "w", *"0123456789", "\u2581w"]
    assert [i for _, i in words] == list(range(len(words))) and len(words) + len(extra) <= rows
    m = spm.ModelProto()
    m.trainer_spec.model_type = spm.TrainerSpec.BPE
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = (
        vocab["model"]["vocab"][unk], vocab["model"]["vocab"]["<s>"], vocab["model"]["vocab"]["</s>"], -1)
    m.normalizer_spec.add_dummy_prefix = True
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.name = "identity"
    for word, _ in words:
        p = m.pieces.add()
        if word == unk:
            p.piece, p.type, p.score = word, spm.ModelProto.SentencePiece.UNKNOWN, 0.0
        elif word in special:
            p.piece, p.type, p.score = word, spm.ModelProto.SentencePiece.CONTROL, 0.0
        else:
            p.piece, p.type, p.score = "\u2581" + word, spm.ModelProto.SentencePiece.NORMAL, -1.0
    for k, piece in enumerate(extra):
        p = m.pieces.add()
        p.piece, p.type, p.score = piece, spm.ModelProto.SentencePiece.NORMAL, -2.0 - k
    (path / "tokenizer.model").write_bytes(m.SerializeToString())
