"""Small shared helpers: device and dtype resolution, memory figures (files: files.py; sizes and durations as users
write them: units.py)."""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

from lmserve.files import read_json_object

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}
# --kv-cache-dtype's one-byte formats (codes + a scale per token and head: layers/attention/kv_quant.py); fp8 where torch has it
KV_QUANT_DTYPES = {"int8": torch.int8}
if hasattr(torch, "float8_e4m3fn"):
    KV_QUANT_DTYPES["fp8_e4m3"] = torch.float8_e4m3fn


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


def keeps_gguf(model: str | Path | None, quantization: str | None, device: torch.device, encoder: bool = False) -> bool:
    """Would this model's quantized blocks be kept: a GGUF file (the embedded default is a quantized GGUF) or a local
    GPTQ / AWQ / compressed-tensors directory? Decided by name and config.json: the dtype is needed before the
    weights are read; `auto_quantization` / `auto_prequant` still check the file's types. `encoder`: an encoder whose
    blocks are never kept (an architecture outside loader/gguf_packed.py's KEPT_ENCODERS)."""
    named_gguf = model is None or str(model).lower().endswith(".gguf")
    return device.type == "cpu" and not encoder and quantization in ("auto", "gguf") and (
        named_gguf or _prequantized_dir(model))


def _prequantized_dir(model: str | Path) -> bool:
    """A local Hugging Face directory whose config.json names a pre-quantized method the int kernels can run."""
    config = Path(model).expanduser() / "config.json"
    try:
        q = read_json_object(config).get("quantization_config") if config.is_file() else None
    except (OSError, ValueError):
        return False
    return isinstance(q, dict) and str(q.get("quant_method", "")).lower() in ("gptq", "awq", "compressed-tensors")


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, kept_gguf: bool, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype -> torch dtype. auto: float16 where a GGUF file's blocks are kept (CPU; llama.cpp's default
    KV type, half the bytes a decode step reads), else the model's dtype. CUDA keeps the model's dtype."""
    if name == "auto":
        return torch.float16 if kept_gguf else model_dtype
    if name in KV_QUANT_DTYPES:
        if device.type != "cpu":
            raise ValueError(f"{name} KV caches run on the CPU kernels only")
        return KV_QUANT_DTYPES[name]
    if name not in ("float32", "float16"):
        raise ValueError(f"unknown KV cache dtype {name!r} (choose from auto, float32, float16, "
                         f"{', '.join(KV_QUANT_DTYPES)})")
    dtype = DTYPES[name]
    if device.type == "cuda" and dtype != model_dtype:
        raise ValueError(f"on CUDA the KV cache takes the model's dtype ({str(model_dtype).removeprefix('torch.')})")
    return dtype


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV cache on `device`."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


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


def malloc_trim() -> None:
    """glibc's malloc_trim(0): give the heap's free pages back to the system (a no-op off glibc).

    keep_freed_memory keeps glibc from doing it by itself, so without this one large request (a 4 MiB body, its
    JSON, its tokens) leaves its peak resident for the life of the process.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
