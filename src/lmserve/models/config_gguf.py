"""ModelConfig from GGUF metadata: the keys every llama.cpp architecture writes the same way, then the
family's own (its hook in models/<family>.py). llama.cpp hard-codes some hyperparameters per architecture
instead of writing them (Gemma's window patterns, SmolLM3's NoPE layers); the family hooks do the same."""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

import torch

from lmserve.errors import CheckpointError
from lmserve.layers.rotary import yarn_attention_factor
from lmserve.models.config import ModelConfig
from lmserve.models.family import Fields, GGUFMeta
from lmserve.models.registry import GGUF_ARCHITECTURES

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
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"GGUF metadata: malformed value: {e}") from None
    if not fields.get("sliding_window") or "sliding" not in fields.get("layer_types", ()):
        fields |= {"sliding_window": None, "layer_types": ()}
    return ModelConfig(**fields)


def common_fields(m: GGUFMeta, vocab_size: int) -> Fields:
    """What every architecture's metadata says the same way (llama.cpp's defaults where a key is optional)."""
    hidden = int(m.require("embedding_length"))
    num_heads = int(m.require("attention.head_count"))
    head_dim = int(m.get("attention.key_length") or hidden // num_heads)  # llama.cpp's n_embd_head_k
    rot = m.get("rope.dimension_count")
    eos = m.meta.get("tokenizer.ggml.eos_token_id")
    return dict(
        architecture=m.arch, vocab_size=vocab_size, hidden_size=hidden,
        intermediate_size=int(m.require("feed_forward_length")), num_layers=int(m.require("block_count")),
        num_heads=num_heads, num_kv_heads=int(m.get("attention.head_count_kv") or num_heads), head_dim=head_dim,
        rms_norm_eps=float(m.require("attention.layer_norm_rms_epsilon")),
        rope_theta=float(m.get("rope.freq_base", 10000.0)), rope_scaling=_scaling(m),
        rotary_dim=int(rot) if rot and int(rot) != head_dim else None,
        max_position_embeddings=int(m.require("context_length")),
        tie_word_embeddings=False,  # decided by the loader from the presence of output.weight
        bos_token_id=m.meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=(int(eos),) if eos is not None else (),
    )


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
