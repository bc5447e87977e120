"""The rotary tables a config asks for: one per kind of layer that rotates (layers/rotary.RotaryTables)."""

from __future__ import annotations

import math

import torch

from lmserve.errors import CheckpointError
from lmserve.layers.blocks.rotary import inv_frequencies, yarn_attention_factor
from lmserve.models.config import ModelConfig

RopeSpecs = dict[str, tuple[torch.Tensor, float]]  # kind -> (inverse frequencies, attention factor)


def rope_specs(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> RopeSpecs:
    """Inverse frequencies and attention factor of the "full" and "sliding" tables the layers read.

    `freq_factors`: a Llama 3.1 GGUF's `rope_freqs.weight`, dividing the full table's frequencies.
    """
    kinds = {cfg.rope_kind(i) for i in range(cfg.num_layers)} - {None}
    specs: RopeSpecs = {}
    if "full" in kinds:
        attention = yarn_attention_factor(cfg.rope_scaling) if cfg.rope_type == "yarn" else 1.0
        specs["full"] = _longrope(cfg) if cfg.rope_type == "longrope" else (
            inv_frequencies(cfg.rotated_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_scaling, freq_factors), attention)
    if "sliding" in kinds:  # Gemma 3's local layers: their own base, no scaling
        specs["sliding"] = inv_frequencies(cfg.rotated_dim, cfg.local_rope_theta), 1.0
    return specs


def check_rope(cfg: ModelConfig) -> ModelConfig:
    """`cfg`, once its rotary tables compute to finite numbers: a rope scaling with a field missing, of the wrong type,
    zero or negative is a CheckpointError naming the scaling here (the config's check), not a crash at load."""
    try:
        specs = rope_specs(cfg)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        raise CheckpointError(f"config: rope scaling {cfg.rope_type!r}: missing or malformed field "
                              f"({type(e).__name__}: {str(e)[:80]})") from None
    if not all(bool(torch.isfinite(inv_freq).all()) and math.isfinite(factor) for inv_freq, factor in specs.values()):
        raise CheckpointError(f"config: rope scaling {cfg.rope_type!r} gives frequencies that are not finite numbers")
    return cfg


def _longrope(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-frequency factors, short or long, and an attention factor on cos and sin.

    transformers switches to the long factors for a forward whose longest sequence passes the original
    context, so one request's early keys and later queries can rotate by different tables. Here the choice
    is made once, as llama.cpp makes it: long factors when the served context (`max_model_len`, else the
    model's) passes the original one. Serve with --max-model-len at most the original context to get the
    short factors (and transformers' numbers for prompts that fit it).
    """
    s = cfg.rope_scaling
    original = int(s["original_max_position_embeddings"])
    context = cfg.max_model_len or cfg.max_position_embeddings
    factors = s["long_factor"] if context > original else s["short_factor"]
    if len(factors) != cfg.rotated_dim // 2:
        raise CheckpointError(f"config: LongRoPE has {len(factors)} factors for a rotated width of {cfg.rotated_dim}")
    factor = float(s.get("factor") or cfg.max_position_embeddings / original)
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    inv_freq = inv_frequencies(cfg.rotated_dim, cfg.rope_theta, "longrope", {"ext_factors": list(factors)})
    return inv_freq, float(attention)
