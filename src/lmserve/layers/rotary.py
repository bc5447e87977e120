"""Rotary position embeddings (HF's non-interleaved layout) with default, linear and llama3 scaling."""

from __future__ import annotations

import math

from collections.abc import Mapping
from typing import Any

import torch


def inv_frequencies(head_dim: int, rope_theta: float, rope_type: str = "default",
                    rope_scaling: Mapping[str, Any] | None = None,
                    freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in float32, scaled as `rope_type` and `rope_scaling` say."""
    # Plain values, not ModelConfig: layers sit below models and must not import them.
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope_scaling)
    if freq_factors is not None:  # GGUF llama3 files ship the scaling as `rope_freqs.weight`
        inv_freq = inv_freq / freq_factors.float()
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths stretched, short kept, smooth between."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [num_tokens, 1, head_dim], computed once per forward and shared by all layers."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by the per-token angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
