"""Gemma 2 and Gemma 3 (text): sandwich norms scaling by (1 + w), GeGLU, embeddings scaled by sqrt(hidden),
softmax scale query_pre_attn_scalar ** -0.5, local sliding-window layers interleaved with global ones;
Gemma 2 soft-caps attention scores and logits, Gemma 3 norms q and k per head and gives its local layers
their own RoPE base. Gemma 3's multimodal checkpoints serve their language model.

GGUF: llama.cpp's converter adds the 1 to every norm weight (so the norms' offset is 0 there), and
llama.cpp hard-codes the window patterns, Gemma 3's local base (10000) and the softmax scale (head_dim,
or hidden / heads for the 27B models); the hooks below follow it.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lmserve.errors import CheckpointError
from lmserve.models.config import ModelConfig
from lmserve.models.family import Family, Fields, GGUFMeta, Tensors

_TANH_GELUS = {"gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu"}  # Gemma's configs all mean the tanh form
GGUF_NAMES = {  # llama.cpp's names for the sandwich norms (its "ffn_norm" is the pre-MLP norm here)
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}


def _shared_hf(cfg: Mapping[str, Any], pattern: int) -> Fields:
    """What Gemma 2 and 3 share in config.json (transformers' defaults where a key is missing)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _TANH_GELUS:
        raise CheckpointError(f"config: Gemma activation {act!r} is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError("config: bidirectional Gemma (an embedding model) is not a causal LM")
    n = int(cfg["num_hidden_layers"])
    return {"hidden_act": "gelu_tanh", "sandwich_norm": True, "norm_offset": 1.0,
            "embed_scale": float(cfg["hidden_size"]) ** 0.5, "head_dim": int(cfg.get("head_dim") or 256),
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "sliding_window": cfg.get("sliding_window", 4096),
            "layer_types": tuple("sliding" if (i + 1) % pattern else "full" for i in range(n))}


def _gemma2_hf(cfg: Mapping[str, Any]) -> Fields:
    return _shared_hf(cfg, 2) | {"attn_softcap": cfg.get("attn_logit_softcapping", 50.0),
                                 "final_softcap": cfg.get("final_logit_softcapping", 30.0)}


def _gemma3_hf(cfg: Mapping[str, Any]) -> Fields:
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    fields = _shared_hf(cfg, pattern) | {"qk_norm": True, "attn_softcap": cfg.get("attn_logit_softcapping"),
                                         "final_softcap": cfg.get("final_logit_softcapping")}
    params = cfg.get("rope_parameters") or {}
    if "sliding_attention" not in params and "rope_local_base_freq" not in cfg:
        fields["local_rope_theta"] = 10000.0  # transformers' default local base
    if "full_attention" not in params and "rope_theta" not in params and "rope_theta" not in cfg:
        fields["rope_theta"] = 1_000_000.0  # and global base
    return fields


def _text_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """Gemma3ForConditionalGeneration: the language model's config, with the wrapper's token ids."""
    text = dict(raw.get("text_config") or {})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if key in raw:
            text[key] = raw[key]
    return text


def _language_model(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Tensors:
    """The multimodal checkpoint's language-model tensors under CausalLM's names; vision tensors are dropped."""
    for prefix, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
        if name.startswith(prefix):
            yield new + name[len(prefix):], tensor
            return


def _shared_gguf(m: GGUFMeta, pattern: int | list, big_layers: int) -> Fields:
    n, hidden, heads = int(m.require("block_count")), int(m.require("embedding_length")), \
        int(m.require("attention.head_count"))
    head_dim = int(m.get("attention.key_length") or hidden // heads)
    slides = pattern if isinstance(pattern, list) else [bool((i + 1) % pattern) for i in range(n)]
    return {"hidden_act": "gelu_tanh", "sandwich_norm": True, "norm_offset": 0.0, "embed_scale": float(hidden) ** 0.5,
            "query_pre_attn_scalar": float(hidden // heads if n == big_layers else head_dim),
            "layer_types": tuple("sliding" if s else "full" for s in slides)}


def _gemma2_gguf(m: GGUFMeta) -> Fields:
    return _shared_gguf(m, 2, big_layers=46) | {
        "sliding_window": int(m.get("attention.sliding_window", 4096)),
        "attn_softcap": float(m.get("attn_logit_softcapping", 50.0)),
        "final_softcap": float(m.get("final_logit_softcapping", 30.0))}


def _gemma3_gguf(m: GGUFMeta) -> Fields:
    pattern = m.get("attention.sliding_window_pattern", 6)
    return _shared_gguf(m, [bool(p) for p in pattern] if isinstance(pattern, list) else int(pattern), big_layers=62) \
        | {"qk_norm": True, "sliding_window": int(m.require("attention.sliding_window")), "local_rope_theta": 10000.0}


GEMMA2 = Family("gemma2", hf_fields=_gemma2_hf, gguf_fields=_gemma2_gguf, gguf_names=GGUF_NAMES)
GEMMA3 = Family("gemma3", hf_fields=_gemma3_hf, gguf_fields=_gemma3_gguf, gguf_names=GGUF_NAMES)
# Gemma3ForConditionalGeneration (its tower too): models/gemma3_vision.py, over _text_config and _language_model
