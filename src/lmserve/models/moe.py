"""Mixture-of-experts families: Mixtral, Qwen2-MoE and Qwen3-MoE. Each is the shared CausalLM whose MLP is a
`SparseMoE` (layers/blocks/moe.py) in its sparse layers; these entries say how their config.json and GGUF metadata set
ModelConfig's expert fields and how their checkpoints name expert tensors.

- Mixtral: every layer sparse, weights always renormalised; experts `block_sparse_moe.experts.{e}.w1/w3/w2`
  (gate, up, down). Its GGUF is a `llama` file with expert tensors (models/llama.py reads their keys).
- Qwen3-MoE: QK-norm; `norm_topk_prob`; `decoder_sparse_step` and `mlp_only_layers` keep some layers dense.
- Qwen2-MoE: q/k/v biases, never renormalised in llama.cpp, and a shared expert scaled by sigmoid(gate(x)).

Experts come as one tensor per expert (the Hub's files) or stacked [E, ...] (transformers 5's `experts.gate_up_proj`
and `experts.down_proj`): `expert_tensors` yields the per-expert names the model's parameters have. A GGUF's
stacked `*_exps` tensors are split by the GGUF reader (loader/gguf_loader.py), for Mixtral's `llama` files too.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lmserve.models.config import ModelConfig
from lmserve.models.family import Family, Fields, GGUFMeta, Tensors, gguf_expert_fields
from lmserve.models.llama import _every_layer_slides, _qwen2_hf, _qwen3_hf

# Mixtral's checkpoint names -> the model's (Qwen's): w1 gate, w3 up, w2 down
_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
                  ".w2.": ".down_proj."}


def _mixtral_hf(cfg: Mapping[str, Any]) -> Fields:
    return _every_layer_slides(cfg) | {"num_experts": int(cfg["num_local_experts"]),
                                       "num_experts_per_tok": int(cfg["num_experts_per_tok"]), "norm_topk_prob": True}


def _qwen_experts(cfg: Mapping[str, Any]) -> Fields:
    """Qwen2/3-MoE: layer i is sparse unless in mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (transformers)."""
    n, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    return {"num_experts": int(cfg.get("num_experts") or cfg["num_local_experts"]),
            "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "dense_layers": tuple(i for i in range(n) if i in only or (i + 1) % step)}


def _qwen3_moe_hf(cfg: Mapping[str, Any]) -> Fields:
    return _qwen3_hf(cfg) | _qwen_experts(cfg)


def _qwen2_moe_hf(cfg: Mapping[str, Any]) -> Fields:
    return _qwen2_hf(cfg) | _qwen_experts(cfg) | {
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)}


def expert_tensors(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Tensors:
    """One checkpoint tensor -> the per-expert tensors the model loads (Mixtral's names made Qwen's; stacked split)."""
    if ".block_sparse_moe." in name:
        for old, new in _MIXTRAL_NAMES.items():
            name = name.replace(old, new)
    if name.endswith(".shared_expert_gate.weight") and tensor.dim() == 1:  # llama.cpp stores it as a vector
        tensor = tensor.view(1, -1)
    prefix, _, leaf = name.rpartition(".experts.")
    if not prefix or tensor.dim() != 3:
        yield name, tensor
        return
    # stacked: transformers 5's experts.gate_up_proj [E, 2I, hidden] and experts.down_proj [E, hidden, I]
    kind = leaf.removesuffix(".weight")
    for e in range(tensor.shape[0]):
        base = f"{prefix}.experts.{e}"
        if kind == "gate_up_proj":
            gate, up = tensor[e].chunk(2, dim=0)
            yield f"{base}.gate_proj.weight", gate
            yield f"{base}.up_proj.weight", up
        else:
            yield f"{base}.{kind}.weight", tensor[e]


def _qwen_gguf_experts(m: GGUFMeta, renormalize: bool) -> Fields:
    """llama.cpp's qwen2moe/qwen3moe: the experts' width defaults to feed_forward_length / expert_used_count."""
    fields = gguf_expert_fields(m, renormalize)
    if fields and fields.get("moe_intermediate_size") is None:
        fields["moe_intermediate_size"] = int(m.require("feed_forward_length")) // fields["num_experts_per_tok"]
    return fields


def _qwen3_moe_gguf(m: GGUFMeta) -> Fields:
    return {"qk_norm": True} | _qwen_gguf_experts(m, renormalize=True)  # llama.cpp's qwen3moe renormalises


def _qwen2_moe_gguf(m: GGUFMeta) -> Fields:
    shared = int(m.get("expert_shared_feed_forward_length") or m.require("feed_forward_length"))  # llama.cpp's default
    return {"qkv_bias": True, "shared_expert_intermediate_size": shared} \
        | _qwen_gguf_experts(m, renormalize=False)  # llama.cpp's qwen2moe does not renormalise


MIXTRAL = Family("mixtral", hf_fields=_mixtral_hf, checkpoint_tensors=expert_tensors)
QWEN3_MOE = Family("qwen3moe", hf_fields=_qwen3_moe_hf, gguf_fields=_qwen3_moe_gguf, checkpoint_tensors=expert_tensors)
QWEN2_MOE = Family("qwen2moe", hf_fields=_qwen2_moe_hf, gguf_fields=_qwen2_moe_gguf, checkpoint_tensors=expert_tensors)
