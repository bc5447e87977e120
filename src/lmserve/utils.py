"""Small shared helpers: device and dtype resolution, memory figures."""

from __future__ import annotations

import os

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


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bf16 on CUDA and on CPUs with native bf16 matmul, float32 otherwise."""
    if name == "auto":
        fast = device.type == "cuda" or cpu_has_fast_bf16()
        return torch.bfloat16 if fast else torch.float32
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
