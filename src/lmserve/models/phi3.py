"""Phi-3 / Phi-3.5 / Phi-4-mini: a Llama-shaped decoder whose checkpoints store q/k/v and gate/up fused,
with LongRoPE scaling (short and long factors) and, on the newer models, partial rotary.

The fused tensors are split into their parts on the way in, so the shared CausalLM, tensor parallelism
and LoRA see the usual q/k/v and gate/up names. GGUF (llama.cpp's "phi3") keeps the same fusion
(`attn_qkv`, and `ffn_up` holding gate then up) and ships the LongRoPE factors as two small tensors.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lmserve.models.config import ModelConfig
from lmserve.models.family import Family, Fields, GGUFMeta, Tensors

GGUF_NAMES = {
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",  # gate rows, then up rows
}
GGUF_ROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _phi3_hf(cfg: Mapping[str, Any]) -> Fields:
    fields: Fields = _every_layer_window(cfg.get("sliding_window"), int(cfg["num_hidden_layers"]))
    params = cfg.get("rope_parameters") or {}
    scaling = dict(cfg.get("rope_scaling") or params)
    if scaling.get("rope_type", scaling.get("type")) in ("su", "yarn", "longrope"):  # transformers' aliases
        original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        fields["rope_scaling"] = {"rope_type": "longrope", "short_factor": list(scaling["short_factor"]),
                                  "long_factor": list(scaling["long_factor"]),
                                  "original_max_position_embeddings": int(original),
                                  "factor": scaling.get("factor"), "attention_factor": scaling.get("attention_factor")}
    return fields


def _phi3_gguf(m: GGUFMeta) -> Fields:
    fields = _every_layer_window(m.get("attention.sliding_window"), int(m.require("block_count")))
    long, short = (m.tensor(name) for name in GGUF_ROPE_TENSORS)
    if long is not None and short is not None:
        fields["rope_scaling"] = {"rope_type": "longrope", "short_factor": short.flatten().tolist(),
                                  "long_factor": long.flatten().tolist(),
                                  "original_max_position_embeddings": int(m.require("rope.scaling.original_context_length")),
                                  "attention_factor": m.get("rope.scaling.attn_factor")}
    return fields


def _every_layer_window(window: int | None, num_layers: int) -> Fields:
    """Phi-3's window (when the config has one) applies to every layer, as transformers runs it."""
    return {"sliding_window": window, "layer_types": ("sliding",) * num_layers} if window else {}


def _split_fused(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Tensors:
    """qkv_proj -> q_proj, k_proj, v_proj; gate_up_proj -> gate_proj, up_proj (rows; the whole model's sizes)."""
    if ".qkv_proj." in name:
        parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split([cfg.q_size, cfg.kv_size, cfg.kv_size]))
        yield from ((name.replace("qkv_proj", p), t) for p, t in parts)
    elif ".gate_up_proj." in name:
        parts = zip(("gate_proj", "up_proj"), tensor.split([cfg.intermediate_size, cfg.intermediate_size]))
        yield from ((name.replace("gate_up_proj", p), t) for p, t in parts)
    else:
        yield name, tensor


PHI3 = Family("phi3", hf_fields=_phi3_hf, gguf_fields=_phi3_gguf, gguf_names=GGUF_NAMES,
              checkpoint_tensors=_split_fused)
