"""ModelConfig from a Hugging Face config.json: the fields every family shares, then the family's own
(its hook in models/<family>.py), then the per-layer attention kinds."""

from __future__ import annotations

from typing import Any, Mapping

from lmserve.errors import CheckpointError
from lmserve.models.config import MAX_SIZE, ModelConfig
from lmserve.models.family import Fields
from lmserve.models.registry import HF_ARCHITECTURES
from lmserve.models.rope import check_rope

_HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def config_from_hf(raw: Mapping[str, Any]) -> ModelConfig:
    """Normalise a config.json dict; a CheckpointError names what is unsupported or missing."""
    archs = raw.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    name = next((a for a in archs if isinstance(a, str) and a in HF_ARCHITECTURES), None)
    if name is None:
        raise CheckpointError(f"config.json: architectures {str(archs)[:200]} not supported "
                              f"(supported: {', '.join(sorted(HF_ARCHITECTURES))})")
    family = HF_ARCHITECTURES[name]
    try:
        cfg = family.text_config(raw)
        fields = common_fields(cfg, name) | family.hf_fields(cfg)
        return check_rope(ModelConfig(**(fields | _layer_kinds(cfg, fields))))
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:  # a family's field of the wrong type or zero
        raise CheckpointError(f"config.json: missing or malformed field: {str(e)[:200]}") from None


def common_fields(cfg: Mapping[str, Any], name: str) -> Fields:
    """What every family's config.json says the same way."""
    num_heads = _size(cfg, "num_attention_heads")  # checked before it divides (0 was a ZeroDivisionError)
    hidden = _size(cfg, "hidden_size")
    _size(cfg, "num_hidden_layers")  # the families' hooks loop over the layers: 10**12 of them would never end
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    theta, scaling, local_theta, partial = rope_fields(cfg)
    eos = cfg.get("eos_token_id")
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        architecture=name, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads, num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads), head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        local_rope_theta=local_theta, rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=bias, o_bias=bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
    )


def _size(cfg: Mapping[str, Any], key: str) -> int:
    """A count or width of config.json: an integer in 1..MAX_SIZE, else a CheckpointError naming the field."""
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SIZE:
        shown = repr(value)[:40] if isinstance(value, (int, float, str)) else f"a JSON {type(value).__name__}"
        raise CheckpointError(f"config.json: {key} must be an integer in 1..{MAX_SIZE}, got {shown}")
    return value


def rope_fields(cfg: Mapping[str, Any]) -> tuple[float, dict | None, float | None, float]:
    """(theta, scaling of the full layers' table, sliding layers' own theta, partial rotary factor), from the
    classic `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`) or transformers 5's
    `rope_parameters`, flat or keyed by layer type."""
    params = dict(cfg.get("rope_parameters") or {})
    local = None
    if "full_attention" in params or "sliding_attention" in params:
        local, params = params.get("sliding_attention"), dict(params.get("full_attention") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    scaling = dict(cfg.get("rope_scaling") or {k: v for k, v in params.items()
                                                 if k not in ("rope_theta", "partial_rotary_factor")})
    if scaling.get("rope_type", scaling.get("type")) in (None, "default") and not scaling.get("factor"):
        scaling = None
    local_theta = cfg.get("rope_local_base_freq")
    if local is not None:
        if local.get("rope_type", "default") != "default":
            raise CheckpointError(f"config: sliding layers' rope type {local.get('rope_type')!r} is not supported")
        local_theta = local.get("rope_theta", local_theta)
    return theta, scaling, None if local_theta is None else float(local_theta), partial


def _layer_kinds(cfg: Mapping[str, Any], fields: Fields) -> Fields:
    """Which layers slide: config.json's explicit `layer_types`, else the family's rule; none without a window."""
    window = fields.get("sliding_window")
    explicit = cfg.get("layer_types")
    kinds = tuple(_HF_LAYER_TYPES.get(t, t) for t in explicit) if explicit else fields.get("layer_types")
    if not window or not kinds or "sliding" not in kinds:
        return {"sliding_window": None, "layer_types": ()}
    return {"sliding_window": int(window), "layer_types": tuple(kinds)}
