"""Quantized KV cache rows (--kv-cache-dtype int8 | fp8_e4m3): the plain PyTorch codec.

Each token's K (and V) row of one KV head, D values, is one quantization block: D codes and then its scale as a
float32 in the row's last 4 bytes, so a cache is [2, blocks, block_size, kv_heads, D + 4] of one-byte elements and
a block's K/V move, share and free as before. int8: code = round_half_even(x * 127 / amax), scale = amax / 127.
fp8_e4m3: code = float8_e4m3fn(x * 448 / amax), scale = amax / 448. A value reads back as code * scale. A row's
codes depend only on its own values (not on its block's other tokens, the batch, or how a prompt was chunked), so
prefill, decode and prefix hits keep one bit pattern per token, as the float caches do. Bytes per token and head:
D + 4 against 2 D for float16 (0.53x at D = 64, 0.52x at D = 128).

The native kernels write and read the same layout (csrc/kv_cache.h: quantized in the write, read in place by the
paged attention); this module is their reference (tests/test_kv_quant.py) and the path where they are absent.
"""

from __future__ import annotations

import torch

from lmserve.utils import KV_QUANT_DTYPES

SCALE_BYTES = 4
# element type -> its largest code (the scale maps a row's largest |value| to it)
_MAX_CODE = {dtype: 127.0 if dtype == torch.int8 else 448.0 for dtype in KV_QUANT_DTYPES.values()}


def is_quantized(dtype: torch.dtype) -> bool:
    """True for the one-byte KV element types that carry a per-row scale."""
    return dtype in _MAX_CODE


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, KV head) row of a cache of `dtype`: D, or D codes + a 4-byte scale."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] float32 -> [..., D + 4] of `dtype`: each row's codes, then its float32 scale."""
    top = _MAX_CODE[dtype]
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))  # float32 division, as the C++ writer
    y = x * inv
    codes = torch.round(y).clamp(-top, top).to(dtype) if dtype == torch.int8 else y.to(dtype)
    scale = (amax / top).contiguous().view(dtype)  # the float32 scale's 4 bytes as 4 elements
    return torch.cat([codes, scale], dim=-1)


def dequantize(rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 4] codes and scales -> [..., D] values (code * scale, in float32, then `out_dtype`)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].float() * scale).to(out_dtype)


def as_values(cache_part: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Cached rows as values in `out_dtype`: dequantized where the cache is quantized, else converted."""
    return dequantize(cache_part, out_dtype) if is_quantized(cache_part.dtype) else cache_part.to(out_dtype)
