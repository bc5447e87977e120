"""ModelConfig from GGUF metadata: the keys every llama.cpp architecture writes the same way, then the
family's own (its hook in models/<family>.py). llama.cpp hard-codes some hyperparameters per architecture
instead of writing them (Gemma's window patterns, SmolLM3's NoPE layers); the family hooks do the same."""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

import numpy as np
import torch

from lmserve.errors import CheckpointError
from lmserve.layers.blocks.rotary import yarn_attention_factor
from lmserve.models.config import MAX_SIZE, ModelConfig
from lmserve.models.family import Fields, GGUFMeta
from lmserve.models.registry import GGUF_ARCHITECTURES
from lmserve.models.rope import check_rope

_SCALING = {None: None, "none": None, "longrope": None}  # LongRoPE comes from its tensors (models/phi3.py)


def config_from_gguf(meta: Mapping[str, Any], arch: str, vocab_size: int,
                     tensor: Callable[[str], torch.Tensor | None] = lambda name: None,
                     tensor_names: Collection[str] = ()) -> ModelConfig:
    """Normalise GGUF metadata (`meta` maps key -> python value, `arch` = general.architecture); `tensor`
    reads a small tensor by name (rope factors); `tensor_names`: the file's (which layers have experts)."""
    family = GGUF_ARCHITECTURES.get(arch)
    if family is None:
        raise CheckpointError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(GGUF_ARCHITECTURES))})")
    m = GGUFMeta(meta, arch, tensor, tensor_names)
    try:
        fields = common_fields(m, vocab_size) | family.gguf_fields(m)
    except CheckpointError:
        raise
    except (TypeError, ValueError, ArithmeticError) as e:  # a family's key of the wrong type or zero
        raise CheckpointError(f"GGUF metadata: malformed value: {e}") from None
    if not fields.get("sliding_window") or "sliding" not in fields.get("layer_types", ()):
        fields |= {"sliding_window": None, "layer_types": ()}
    return check_rope(ModelConfig(**fields))


def common_fields(m: GGUFMeta, vocab_size: int) -> Fields:
    """What every architecture's metadata says the same way (llama.cpp's defaults where a key is optional)."""
    hidden = size(m, "embedding_length")
    num_heads = size(m, "attention.head_count")  # checked before it divides: head_count 0 was a ZeroDivisionError
    head_dim = size(m, "attention.key_length", hidden // num_heads)  # llama.cpp's n_embd_head_k
    rot = size(m, "rope.dimension_count", head_dim)
    eos = m.meta.get("tokenizer.ggml.eos_token_id")
    return dict(
        architecture=m.arch, vocab_size=vocab_size, hidden_size=hidden,
        intermediate_size=size(m, "feed_forward_length"), num_layers=size(m, "block_count"),
        num_heads=num_heads, num_kv_heads=size(m, "attention.head_count_kv", num_heads), head_dim=head_dim,
        # an encoder's LayerNorm writes attention.layer_norm_epsilon instead (llama.cpp's BERT)
        rms_norm_eps=number(m, "attention.layer_norm_rms_epsilon", m.get("attention.layer_norm_epsilon")),
        rope_theta=number(m, "rope.freq_base", 10000.0), rope_scaling=_scaling(m),
        rotary_dim=rot if rot != head_dim else None,
        max_position_embeddings=size(m, "context_length"),
        tie_word_embeddings=False,  # decided by the loader from the presence of output.weight
        bos_token_id=m.meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=(int(eos),) if eos is not None else (),
    )


def size(m: GGUFMeta, key: str, default: int | None = None) -> int:
    """`{arch}.{key}`, a count or a width: an integer in 1..MAX_SIZE (absent or 0 with a `default`: the default, as
    llama.cpp reads them); else a CheckpointError naming the key, before anything divides by it or loops over it."""
    value = m.get(key)
    if default is not None and (value is None or (_is_int(value) and value == 0)):
        return default
    if value is None:
        raise CheckpointError(f"GGUF metadata: missing {m.arch}.{key}")
    if not _is_int(value) or not 0 < value <= MAX_SIZE:
        shown = repr(value)[:40] if isinstance(value, (int, float, str, np.generic)) else f"a {type(value).__name__}"
        raise CheckpointError(f"GGUF metadata: {m.arch}.{key} must be an integer in 1..{MAX_SIZE}, got {shown}")
    return int(value)


def number(m: GGUFMeta, key: str, default: float | None = None) -> float:
    """`{arch}.{key}` as a float (an integer or a float in the file); else a CheckpointError naming the key."""
    value = m.get(key, default)
    if value is None:
        raise CheckpointError(f"GGUF metadata: missing {m.arch}.{key}")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise CheckpointError(f"GGUF metadata: {m.arch}.{key} must be a number, got a {type(value).__name__}")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _scaling(m: GGUFMeta) -> dict | None:
    kind = m.get("rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(m.require("rope.scaling.factor"))}
    if kind == "yarn":  # llama.cpp's defaults; it always rounds the ramp's ends outward (truncate)
        scaling = {"rope_type": "yarn", "factor": float(m.require("rope.scaling.factor")),
                   "original_max_position_embeddings": int(m.require("rope.scaling.original_context_length")),
                   "beta_fast": float(m.get("rope.scaling.yarn_beta_fast", 32.0)),
                   "beta_slow": float(m.get("rope.scaling.yarn_beta_slow", 1.0)), "truncate": True}
        if m.get("rope.scaling.attn_factor") is not None:  # llama.cpp multiplies YaRN's own factor by it
            scaling["attention_factor"] = float(m.get("rope.scaling.attn_factor")) * yarn_attention_factor(scaling)
        return scaling
    if kind not in _SCALING:
        raise CheckpointError(f"GGUF metadata: rope scaling type {kind!r} is not supported")
    return None
