"""Rotary position embeddings (HF's non-interleaved layout): default, linear, llama3, YaRN and LongRoPE scaling,
partial rotary (the first `rotary_dim` of each head), one table per kind of layer (Gemma 3's local
layers rotate with their own base), and M-RoPE (Qwen2-VL / Qwen2.5-VL: three position axes, each turning its own
section of the frequencies)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def inv_frequencies(head_dim: int, rope_theta: float, rope_type: str = "default",
                    rope_scaling: Mapping[str, Any] | None = None,
                    freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in float32, scaled as `rope_type` and `rope_scaling` say.

    `head_dim` is the rotated width (the whole head, or its first part with partial rotary). LongRoPE's
    `rope_scaling` carries "ext_factors", the short or long factor list the model chose (models/rope.py).
    """
    # Plain values, not ModelConfig: layers sit below models and must not import them.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope_type == "longrope":  # transformers' order: 1 / (factor * base ** (2i / d))
        ext = torch.tensor(rope_scaling["ext_factors"], dtype=torch.float32)
        return 1.0 / (ext * rope_theta ** exponents)
    inv_freq = 1.0 / (rope_theta ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif rope_type == "yarn":
        inv_freq = _yarn_blend(inv_freq, head_dim, rope_theta, rope_scaling)
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


def _yarn_blend(inv_freq: torch.Tensor, dim: int, base: float, s: Mapping[str, Any]) -> torch.Tensor:
    """YaRN (transformers' order of operations): high frequencies kept, low ones divided by `factor`, a linear ramp
    between the dims that turn `beta_fast` and `beta_slow` times over the original context."""
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])
    fast, slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the frequency as is), 0: interpolate (divided by factor)
    return (inv_freq / factor) * (1 - keep) + inv_freq * keep


def yarn_attention_factor(s: Mapping[str, Any]) -> float:
    """YaRN's scale on cos and sin: `attention_factor`, else 0.1 ln(factor) + 1 (or DeepSeek's mscale ratio)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(float(s["mscale"])) / mscale(float(s["mscale_all_dim"]))
    return mscale()


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
            attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [num_tokens, 1, rotary_dim], computed once per forward and shared by all layers.

    LongRoPE scales both by its attention factor (in float32, before the cast, as transformers does)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, rotary_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, sections: tuple[int, ...], dtype: torch.dtype,
                  attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE's cos, sin [num_tokens, 1, rotary_dim] from positions [3, num_tokens] (time, height, width).

    Frequency pair j turns with the axis whose section holds j (`sections` in pairs, summing to rotary_dim / 2,
    Qwen2.5-VL's `mrope_section`); both halves of the head use the same choice, as in transformers. Where the
    three axes agree (every text token) this is `cos_sin` of that one position.
    """
    pos, parts, start = positions.to(torch.float32), [], 0
    for axis, n in enumerate(sections):  # slices, no index tensor: nothing is built on the host per forward
        parts.append(pos[axis][:, None] * inv_freq[None, start:start + n])
        start += n
    freqs = torch.cat(parts, dim=-1)  # [T, rotary_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by the per-token angles (the first cos.shape[-1] dims only:
    partial rotary leaves the rest of each head as it is)."""
    rot = cos.shape[-1]
    if rot != x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RotaryTables(nn.Module):
    """One cos/sin table per kind of layer ("full", "sliding"), computed once per forward for all layers.

    `specs` maps a kind to (inverse frequencies [rotary_dim // 2], attention factor). The frequencies are
    buffers: they follow `.to(device)`, and `reset` recomputes them where a model was built on the meta device.
    `mrope_section` (M-RoPE models): positions may come as [3, T], each axis turning its section of the pairs;
    [T] positions (a step with no image token: every axis equal) take the plain table.
    """

    def __init__(self, specs: Mapping[str, tuple[torch.Tensor, float]], mrope_section: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.kinds = tuple(specs)
        self.mrope_section = tuple(mrope_section)
        self.factors = {kind: factor for kind, (_, factor) in specs.items()}
        for kind, (inv_freq, _) in specs.items():
            self.register_buffer(f"inv_freq_{kind}", inv_freq, persistent=False)

    def reset(self, specs: Mapping[str, tuple[torch.Tensor, float]], device: torch.device) -> None:
        """Put freshly computed frequencies in place (float32, on `device`)."""
        for kind, (inv_freq, _) in specs.items():
            setattr(self, f"inv_freq_{kind}", inv_freq.to(device))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """kind -> (cos, sin), each [T, 1, rotary_dim]; positions [T], or [3, T] with `mrope_section`."""
        if positions.dim() == 2:
            return {kind: mrope_cos_sin(positions, getattr(self, f"inv_freq_{kind}"), self.mrope_section, dtype,
                                        self.factors[kind]) for kind in self.kinds}
        return {kind: cos_sin(positions, getattr(self, f"inv_freq_{kind}"), dtype, self.factors[kind])
                for kind in self.kinds}
