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
            outtype: str = "f32") -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) of a transformers vision-language model directory. `text_architecture` goes into a
    copy's text_config.architectures, where the released checkpoints have it (SmolVLM: VLlama3ForCausalLM) and the
    converter looks for it."""
    src = require_converter()
    work = out_dir / (model_dir.name + "-convert")
    shutil.copytree(model_dir, work, dirs_exist_ok=True)
    cfg = json.loads((work / "config.json").read_text())
    cfg.setdefault("text_config", {})["architectures"] = [text_architecture]
    (work / "config.json").write_text(json.dumps(cfg, indent=1))
    text, mmproj = out_dir / f"{model_dir.name}-{outtype}.gguf", out_dir / f"mmproj-{model_dir.name}-{outtype}.gguf"
    for extra, out in (([], text), (["--mmproj"], mmproj)):
        p = subprocess.run([sys.executable, "-c", _RUN, str(src), str(work), "--outtype", outtype, "--outfile",
                            str(out), *extra], capture_output=True, text=True, timeout=600)
        assert p.returncode == 0 and out.is_file(), p.stderr[-3000:]
    return text, mmproj
