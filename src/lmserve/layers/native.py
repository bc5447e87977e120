"""Optional C++ kernels, compiled on first use with torch's cpp_extension (g++ and ninja needed).

One extension module (layers/csrc/): paged decode attention, the fused row-wise ops of a decoder
layer (RMSNorm with the residual add, SiLU-and-mul, rotary), the skinny matmul for steps of a few
rows, and matmuls over a GGUF file's quantized codes (quant_gemm.cpp), all CPU float32. It is built once per
machine into ~/.cache/lmserve/kernels/<key> (the key covers the sources, torch version and CPU flags,
since the code is compiled for this CPU: -march=native). Where it cannot be built — no compiler, or
LMSERVE_NATIVE_KERNELS=0 — callers fall back to the PyTorch path, with one log line. A build is made
in a private directory and renamed into place, so an interrupted build never blocks a later start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

ENV_SWITCH = "LMSERVE_NATIVE_KERNELS"
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_decode_attention.cpp", "fused_ops.cpp", "gemv.cpp", "quant_gemm.cpp",
                                          "decode_stack.cpp", "bindings.cpp")]
# fast-math lets GCC vectorise the reductions and exp; finite-math stays off (masked -inf must compare)
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False
# Read once: the switch is a start-up setting, and this function runs ~100 times per decode step.
_on = os.environ.get(ENV_SWITCH, "1") != "0"


def native_module() -> ModuleType | None:
    """The compiled module (ops in csrc/bindings.cpp), or None where it is off or cannot be built."""
    global _module, _tried
    if _tried or not _on:
        return _module if _on else None
    with _lock:
        if not _tried:
            _module = _build()
            _tried = True
    return _module


def _build() -> ModuleType | None:
    root = Path(os.environ.get("LMSERVE_CACHE_DIR", Path.home() / ".cache" / "lmserve")) / "kernels"
    final = root / _key()
    try:
        if not _library(final):
            _compile(root, final)
        module = _import(_library(final))
    except Exception as e:  # no compiler / ninja, or a build error: the PyTorch path still works
        log.warning("native CPU kernels unavailable (%s: %s); using the PyTorch paths", type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "")
        return None
    log.debug("native CPU kernels loaded from %s", final)  # the usual case: nothing to say at INFO
    return module


def _compile(root: Path, final: Path) -> None:
    """Build in a private directory, then rename it into place.

    The sources are copied next to the build so its files name no checkout: every checkout and venv
    with the same sources, torch and CPU shares one build. A build killed half-way leaves only its own
    temporary directory (no lock that later starts would wait on forever); two processes that build at
    once both succeed and the first rename wins.
    """
    import shutil
    import tempfile
    import time

    from torch.utils import cpp_extension

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"build-{final.name}-", dir=root))
    try:
        for src in [*_CSRC.glob("*.cpp"), *_CSRC.glob("*.h")]:
            shutil.copy2(src, tmp / src.name)
        # a first start is otherwise minutes of silence (g++ -O3 on 2 cores: ~1-3 min)
        log.info("compiling native kernels (first start on this CPU; 1-2 minutes on 2 cores) ...")
        t0 = time.perf_counter()
        cpp_extension.load(name="lmserve_native", sources=[str(tmp / p.name) for p in _SOURCES],
                           extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], build_directory=str(tmp),
                           verbose=False)
        log.info("native kernels compiled in %.0f s", time.perf_counter() - t0)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first: keep its build
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _library(directory: Path) -> Path | None:
    """The built extension in `directory`, if a complete build is there."""
    found = sorted(directory.glob("lmserve_native*.so")) if directory.is_dir() else []
    return found[0] if found else None


def _import(path: Path) -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location("lmserve_native", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _key() -> str:
    flags = ""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        pass
    sources = b"".join(p.read_bytes() for p in sorted([*_CSRC.glob("*.cpp"), *_CSRC.glob("*.h")]))
    h = hashlib.sha256(sources + torch.__version__.encode() + flags.encode() + " ".join(_CFLAGS).encode())
    return h.hexdigest()[:16]


def build_key() -> str | None:
    """What the loaded kernels were built from (sources, torch version, CPU flags), or None where they are off:
    bytes they computed are reproduced only by the same build (the KV tier keys its blocks by it)."""
    return _key() if native_module() is not None else None
