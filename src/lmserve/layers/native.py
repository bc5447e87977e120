"""Optional C++ kernels, compiled on first use with torch's cpp_extension (g++ and ninja needed).

Only one today: paged decode attention on CPU (layers/csrc/paged_decode_attention.cpp). It is built
once per machine into ~/.cache/lmserve/kernels/<key> (the key covers the source, torch version and
CPU flags, since the code is compiled for this CPU: -march=native). Where it cannot be built — no
compiler, or LMSERVE_NATIVE_KERNELS=0 — callers fall back to the PyTorch path, with one log line.
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
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
# fast-math lets GCC vectorise the reductions and exp; finite-math stays off (masked -inf must compare)
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def paged_decode_kernel() -> ModuleType | None:
    """The compiled module (with `paged_decode_attention`), or None where it is off or cannot be built."""
    global _module, _tried
    if _tried or not enabled():
        return _module if enabled() else None
    with _lock:
        if not _tried:
            _module = _build()
            _tried = True
    return _module


def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    build_dir = Path(os.environ.get("LMSERVE_CACHE_DIR", Path.home() / ".cache" / "lmserve")) / "kernels" / _key()
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        module = cpp_extension.load(name="lmserve_paged_decode", sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as e:  # no compiler / ninja, or a build error: the PyTorch path still works
        log.warning("native paged attention unavailable (%s: %s); using PyTorch SDPA", type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "")
        return None
    log.info("native paged decode attention loaded from %s", build_dir)
    return module


def _key() -> str:
    flags = ""
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        pass
    h = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode() + flags.encode() + " ".join(_CFLAGS).encode())
    return h.hexdigest()[:16]
