"""Small shared helpers: device and dtype resolution, memory figures."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return device


def cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo ('' where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def cpu_has_fast_bf16(flags: str | None = None) -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slow."""
    found = (cpu_flags() if flags is None else flags).split()
    return "avx512_bf16" in found or "amx_bf16" in found


def auto_dtype(device: torch.device, flags: str | None = None) -> torch.dtype:
    """What `--dtype auto` means: bf16 on CUDA and on CPUs with AMX, float32 on every other CPU.

    bf16 on CPU gives up batch invariance (a request's tokens would depend on what shares its step)
    and the native float32 kernels; auto makes that trade only with AMX, whose bf16 tile matmul is
    much faster than float32, and keeps float32 on AVX512-BF16 alone (Zen 4). `flags` is a cpuinfo
    flags line (default: this machine's).
    """
    if device.type == "cuda":
        return torch.bfloat16
    found = (cpu_flags() if flags is None else flags).split()
    return torch.bfloat16 if "amx_bf16" in found else torch.float32


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A --dtype name -> torch dtype; 'auto' as auto_dtype decides."""
    if name == "auto":
        return auto_dtype(device)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (choose from auto, float32, bfloat16, float16)")
    return DTYPES[name]


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV cache on `device`."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def env_int(name: str) -> int | None:
    """An integer environment variable, or None."""
    value = os.environ.get(name)
    return int(value) if value else None


def keep_freed_memory() -> bool:
    """Stop glibc from returning large freed blocks to the OS after every step.

    Each decode step allocates multi-MB temporaries (gathered K/V, activations); by default glibc
    serves them with fresh mmaps and unmaps them on free, so every step pays page faults on memory
    it just had (measured: a batch-32 decode step 473 ms -> 225 ms). Called after the weights are
    loaded, so they keep their huge-page-eligible mappings. No-op off glibc.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 31))


def user_data_dir() -> Path:
    """lmserve's user data (playground shares, batch jobs): $XDG_DATA_HOME/lmserve, ~/.local/share/lmserve when unset."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "lmserve"


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; ValueError saying what is wrong (callers add the file's role)."""
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    return data
