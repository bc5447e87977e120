"""Quantized KV cache rows (--kv-cache-dtype int8 | fp8_e4m3): the plain PyTorch codec.

Each token's K (and V) row of one KV head, D values, is stored as D one-byte codes followed by one float16 scale per
block of 32 values (ggml's q8_0 blocks), so a cache is [2, blocks, block_size, kv_heads, D + D / 16] of one-byte
elements and a block's K/V move, share and free as before. int8: d = float16(amax / 127), code =
round_half_even(x / d); fp8_e4m3: d = float16(amax / 448), code = e4m3(x / d); 1 / d is taken once and multiplied,
and the quotient is clamped to the largest code (d was rounded). A value reads back as code * d. A row's codes depend
only on its own values (not on its block's other tokens, the batch, or how a prompt was chunked), so prefill, decode
and prefix hits keep one bit pattern per token, as the float caches do. Bytes per token and head: D + D / 16 against
2 D for float16 (0.53x). Blocks of 32 with float16 scales cost what one float32 scale per 64 values does, and kept
perplexity closer to the float16 cache's (benchmarks/results/perplexity_kv.md).

The native kernels write and read the same layout (csrc/kv_cache.h: quantized in the write, read in place by the
paged attention); this module is their reference (tests/test_kv_quant.py) and the path where they are absent.
"""

from __future__ import annotations

import torch

from lmserve.utils import KV_QUANT_DTYPES

BLOCK = 32  # values per scale
# element type -> its largest code (the scale maps a row's largest |value| to it)
_MAX_CODE = {dtype: 127.0 if dtype == torch.int8 else 448.0 for dtype in KV_QUANT_DTYPES.values()}


def is_quantized(dtype: torch.dtype) -> bool:
    """True for the one-byte KV element types that carry a per-row scale."""
    return dtype in _MAX_CODE


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, KV head) row of a cache of `dtype`: D, or D codes + a 2-byte scale per 32."""
    return head_dim + head_dim // BLOCK * 2 if is_quantized(dtype) else head_dim


def check_head_dim(head_dim: int, dtype: torch.dtype) -> None:
    """ValueError where a cache of `dtype` cannot hold rows of `head_dim` (quantized rows are whole blocks of 32)."""
    if is_quantized(dtype) and head_dim % BLOCK:
        raise ValueError(f"quantized KV rows are blocks of {BLOCK} values; this model's head_dim is {head_dim}")


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] float32 -> [..., D + D / 16] of `dtype`: each row's codes, then its blocks' float16 scales."""
    top = _MAX_CODE[dtype]
    shape = x.shape
    blocks = x.float().reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = (amax / top).clamp(max=65504.0).half()  # float16's largest: a huge block saturates, never inf
    wide = d.float()
    inv = torch.where(wide > 0, 1 / wide, torch.zeros_like(wide))  # float32 division, as the C++ writer
    y = (blocks * inv).clamp(-top, top)
    codes = (torch.round(y) if dtype == torch.int8 else y).to(dtype).reshape(shape)
    scales = d.reshape(*shape[:-1], shape[-1] // BLOCK).contiguous().view(dtype)  # each scale's 2 bytes
    return torch.cat([codes, scales], dim=-1)


def dequantize(rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + D / 16] codes and scales -> [..., D] values (code * scale in float32, then `out_dtype`)."""
    d = rows.shape[-1] * 16 // 17
    scales = rows[..., d:].contiguous().view(torch.float16).float()  # [..., D / 32]
    codes = rows[..., :d].float().reshape(*rows.shape[:-1], d // BLOCK, BLOCK)
    return (codes * scales[..., None]).reshape(*rows.shape[:-1], d).to(out_dtype)


def as_values(cache_part: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Cached rows as values in `out_dtype`: dequantized where the cache is quantized, else converted."""
    return dequantize(cache_part, out_dtype) if is_quantized(cache_part.dtype) else cache_part.to(out_dtype)
