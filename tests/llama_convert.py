"""llama.cpp's own converter (convert_hf_to_gguf.py) run on a tiny model made by transformers: the text GGUF and, with
`--mmproj`, the multimodal projector GGUF, exactly as llama.cpp's users make them.

The converter comes from the llama-cpp-python sdist that benchmarks/build_llama_server.sh downloads into
benchmarks/.cache/sdist (or the llama.cpp tree named by LLAMA_CPP_SRC); without it the tests that need it skip.
One change is made to its run: the tiny models' word-level tokenizer is no pre-tokenizer llama.cpp knows by its
hash, so the converter is told it is SmolLM's (`smollm`, what SmolVLM's real tokenizer hashes to) instead of
refusing it; the vocabulary, the tensors and every other metadata key are the converter's own.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
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
            outtype: str = "f32", sentencepiece: bool = False,
            released: dict[str, str] | None = None, newlines: bool = False) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) of a transformers vision-language model directory. `text_architecture` goes into a
    copy's text_config.architectures, where the released checkpoints have it (SmolVLM: VLlama3ForCausalLM) and the
    converter looks for it. `released`: tensor-name prefixes the copy's checkpoint is renamed by (old -> new), where
    transformers saves a name that the released checkpoints and the converter spell otherwise. `sentencepiece`: the
    copy gets the word-level vocabulary as a SentencePiece model
    (`write_sentencepiece`), so the text GGUF carries a tokenizer lmserve and llama.cpp both run; `newlines`: with
    "\n" and "\n\n" pieces as well, which llama.cpp's mtmd looks up to frame an Idefics3 image (without them every
    image request to llama-server is a 400 "Invalid token")."""
    src = require_converter()
    text, mmproj = out_dir / f"{model_dir.name}-{outtype}.gguf", out_dir / f"mmproj-{model_dir.name}-{outtype}.gguf"
    cache = cache_dir(model_dir, src, _RUN, text_architecture, outtype, sentencepiece, released,
                      *(("newlines",) if newlines else ()))
    if from_cache(cache, (text, mmproj)):
        return text, mmproj
    work = out_dir / (model_dir.name + "-convert")
    shutil.copytree(model_dir, work, dirs_exist_ok=True)
    cfg = json.loads((work / "config.json").read_text())
    cfg.setdefault("text_config", {})["architectures"] = [text_architecture]
    if sentencepiece:
        write_sentencepiece(work, int(cfg["text_config"]["vocab_size"]), newlines)
    (work / "config.json").write_text(json.dumps(cfg, indent=1))
    if released:
        rename_tensors(work / "model.safetensors", released)
    for extra, out in (([], text), (["--mmproj"], mmproj)):
        p = subprocess.run([sys.executable, "-c", _RUN, str(src), str(work), "--outtype", outtype, "--outfile",
                            str(out), *extra], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0 and out.is_file(), p.stderr[-3000:]
    to_cache(cache, (text, mmproj))
    return text, mmproj


@functools.lru_cache(maxsize=None)
def _converter_digest(src: Path) -> str:
    """The converter's own code (convert_hf_to_gguf.py and conversion/): a tree updated in place is a new key."""
    h = hashlib.sha256()
    for f in [src / "convert_hf_to_gguf.py", *sorted((src / "conversion").rglob("*.py"))]:
        h.update(f.read_bytes())
    return h.hexdigest()


def cache_dir(model_dir: Path, src: Path, *args: object) -> Path:
    """~/.cache/lmserve/converted/<digest of the model directory's files, the converter's path and code, the
    installed transformers (the converter reads tokenizers through it) and the arguments (callers pass the script
    they run the converter with)>: the tiny models are seeded, so the same test makes the same files and the
    converter (a minute on a loaded 2-core machine) runs once per machine. Files in subdirectories count by their
    relative path (a sentence-transformers directory's 1_Pooling/config.json)."""
    from importlib.metadata import version

    h = hashlib.sha256(repr((str(src), _converter_digest(src), version("transformers"), args)).encode())
    for f in sorted(model_dir.rglob("*")):
        if f.is_file():
            h.update(str(f.relative_to(model_dir)).encode() + b"\0" + f.read_bytes())
    return Path.home() / ".cache/lmserve/converted" / h.hexdigest()[:24]


def from_cache(cache: Path, outs: tuple[Path, ...]) -> bool:
    """The cached files copied to `outs`, each under a temporary name and renamed (a test in the other worker that
    finds one there never reads half of it); False where the cache lacks one."""
    if not all((cache / o.name).is_file() for o in outs):
        return False
    for o in outs:
        tmp = o.with_name(f"{o.name}.{os.getpid()}.part")
        shutil.copyfile(cache / o.name, tmp)  # an entry is never removed once there (to_cache)
        tmp.replace(o)
    return True


def to_cache(cache: Path, outs: tuple[Path, ...]) -> None:
    """`outs` kept under `cache`, whole or not at all (a killed run leaves only a .tmp directory). An entry already
    there stays: its digest fixes its contents, so it is another process's copy of the same files, and replacing it
    would pull it from under a reader."""
    if cache.is_dir():
        return
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for o in outs:
        shutil.copyfile(o, tmp / o.name)
    try:
        tmp.rename(cache)
    except OSError:  # another process renamed its copy in first
        shutil.rmtree(tmp, ignore_errors=True)


_LEGACY = "tools/mtmd/legacy-models"


def convert_llava_legacy(model_dir: Path, tower, out_dir: Path) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) of a transformers LLaVA-1.5 directory, as llama.cpp's docs/multimodal/llava.md
    makes them: convert_hf_to_gguf.py --mmproj refuses a CLIP tower (its LlavaVisionModel takes Pixtral and Mistral
    only: "Unsupported model type: clip_vision_model"), so the text GGUF comes from convert_hf_to_gguf.py and the
    projector file from the legacy scripts the pinned sdist ships: llava_surgery_v2.py cuts `llava.projector` out of
    the checkpoint, and convert_image_encoder_to_gguf.py writes the CLIP tower (`tower`, transformers' module, as
    the CLIP model directory it reads: write_clip_dir) with it (`--use-f32`; it stores the patch convolution and
    the projector's matrices in float16 whatever it is told)."""
    src = require_converter()
    if not (src / _LEGACY / "convert_image_encoder_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's {_LEGACY} is not in {src} (python scripts/llama_converter.py fetches it)")
    text = out_dir / f"{model_dir.name}-f32.gguf"
    mmproj = out_dir / f"mmproj-{model_dir.name}-f32.gguf"
    cache = cache_dir(model_dir, src, "llava-legacy")
    if from_cache(cache, (text, mmproj)):
        return text, mmproj
    text, _ = _convert_text(model_dir, out_dir, src)
    work, clip = out_dir / (model_dir.name + "-legacy"), out_dir / (model_dir.name + "-clip")
    shutil.copytree(model_dir, work, dirs_exist_ok=True)
    write_clip_dir(tower, clip)
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    for cmd in (["llava_surgery_v2.py", "-m", str(work)],
                ["convert_image_encoder_to_gguf.py", "-m", str(clip), "--use-f32",
                 "--llava-projector", str(work / "llava.projector"), "--output-dir", str(work)]):
        p = subprocess.run([sys.executable, str(src / _LEGACY / cmd[0]), *cmd[1:]], capture_output=True, text=True,
                           timeout=600, env=env)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    shutil.copyfile(work / "mmproj-model-f32.gguf", mmproj)
    to_cache(cache, (text, mmproj))
    return text, mmproj


def write_clip_dir(tower, path: Path) -> None:
    """A CLIP model directory (CLIPModel with `tower`'s weights, a 1-layer text side and a processor), the shape of
    openai/clip-vit-large-patch14-336 that the legacy script reads. Its `--clip-model-is-vision` path for a bare
    vision tower reads `model.vision_model`, which transformers 5's CLIPVisionModel no longer has."""
    import transformers

    cfg = transformers.CLIPConfig(vision_config=tower.config.to_dict(), projection_dim=tower.config.projection_dim,
                                  text_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                   num_attention_heads=2, vocab_size=8, max_position_embeddings=8,
                                                   bos_token_id=0, eos_token_id=1, pad_token_id=1))
    clip = transformers.CLIPModel(cfg)
    clip.vision_model.load_state_dict(tower.state_dict())
    clip.save_pretrained(path)
    words = ["<|startoftext|>", "<|endoftext|>", "a</w>", "a"]
    (path / "vocab.json").write_text(json.dumps({w: i for i, w in enumerate(words)}))
    (path / "merges.txt").write_text("#version: 0.2\n")
    size = tower.config.image_size
    transformers.CLIPProcessor(
        image_processor=transformers.CLIPImageProcessor(size={"shortest_edge": size},
                                                        crop_size={"height": size, "width": size}),
        tokenizer=transformers.CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"))).save_pretrained(path)


def _convert_text(model_dir: Path, out_dir: Path, src: Path) -> tuple[Path, None]:
    """The text GGUF alone (convert_hf_to_gguf.py without --mmproj), with the SentencePiece vocabulary."""
    work = out_dir / (model_dir.name + "-text")
    shutil.copytree(model_dir, work, dirs_exist_ok=True)
    cfg = json.loads((work / "config.json").read_text())
    write_sentencepiece(work, int(cfg["text_config"]["vocab_size"]))
    out = out_dir / f"{model_dir.name}-f32.gguf"
    p = subprocess.run([sys.executable, "-c", _RUN, str(src), str(work), "--outtype", "f32", "--outfile", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and out.is_file(), p.stderr[-3000:]
    return out, None


def rename_tensors(path: Path, prefixes: dict[str, str]) -> None:
    """Rewrite a safetensors file with each name starting with a key of `prefixes` renamed to start with its value."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    renamed = {}
    for name, t in tensors.items():
        old = next((p for p in prefixes if name.startswith(p)), None)
        renamed[name if old is None else prefixes[old] + name[len(old):]] = t
    save_file(renamed, path, metadata={"format": "pt"})


def write_sentencepiece(path: Path, rows: int, newlines: bool = False) -> None:
    """tokenizer.model: the directory's word-level vocabulary (tokenizer.json) as SentencePiece pieces at the same
    ids, so the converter writes a `llama` vocabulary (a word-level one has no merges, which a byte-level BPE GGUF
    needs). Words are spelled "\u2581w12" and the special tokens are control pieces; the pieces a word is merged from
    ("\u2581", "w", the digits, "\u2581w") take the rows after the vocabulary (`rows`: the model's, at least 13 more).
    A prompt of words and special tokens gets the word-level tokenizer's ids, plus a "\u2581" where a space is
    left alone before a special token. `newlines`: "\n" and "\n\n" as user-defined pieces after those."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    vocab = json.loads((path / "tokenizer.json").read_text())
    words = sorted(vocab["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in vocab.get("added_tokens", [])} | {"<s>", "</s>"}
    unk = vocab["model"].get("unk_token", "<pad>")
    extra = ["\u2581", "w", *"0123456789", "\u2581w"]
    user = ["\n", "\n\n"] if newlines else []
    assert [i for _, i in words] == list(range(len(words))) and len(words) + len(extra) + len(user) <= rows
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
    for piece in user:
        p = m.pieces.add()
        p.piece, p.type, p.score = piece, spm.ModelProto.SentencePiece.USER_DEFINED, 0.0
    (path / "tokenizer.model").write_bytes(m.SerializeToString())


def rewrite(src: Path, dst: Path, keys: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of a GGUF file with metadata `keys` set (None: removed; a value: as the file's own type of that key)
    and the tensors named in `drop` left out: a malformed file made from a converted one."""
    import gguf

    keys = keys or {}
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or (
                field.name in keys and keys[field.name] is None):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, keys.get(field.name, field.contents()), kind, sub_type=sub)
    for t in reader.tensors:
        if t.name not in drop:
            writer.add_tensor(t.name, np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]),
                              raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def requantize(src: Path, dst: Path, kind: str) -> Path:
    """A copy of a float GGUF file with its matrices in `kind` blocks (Q8_0, Q4_0, ...: gguf-py's own quantizer,
    llama-quantize's row format), as llama-quantize writes one: every 2-D weight whose rows are whole blocks (the
    projections and the token table), the norms left float32; the metadata copied as gguf_new_metadata.py does,
    with general.file_type set to the type's llama_ftype."""
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[kind]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch=arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        kind_ = field.types[0]
        sub = field.types[-1] if kind_ == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind_, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{kind}"])
    for t in reader.tensors:
        data = np.asarray(t.data)
        shape = [int(d) for d in reversed(t.shape)]  # numpy order: [rows, cols]
        if t.tensor_type == gguf.GGMLQuantizationType.F32 and len(shape) == 2 and shape[-1] % block == 0:
            writer.add_tensor(t.name, quantize(data.reshape(shape), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data.reshape(shape), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
