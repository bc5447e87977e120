"""Llama-shaped families: pre-norm layers, SwiGLU, full rotary. Llama 2/3, Mistral (its sliding window),
Qwen2 (q/k/v biases), Qwen3 (QK-norm), SmolLM3 (NoPE layers). Each is the shared CausalLM; these entries
only say how their config.json and GGUF metadata set ModelConfig."""

from __future__ import annotations

from typing import Any, Mapping

from lmserve.models.family import Family, Fields, GGUFMeta, gguf_expert_fields


def _every_layer_slides(cfg: Mapping[str, Any]) -> Fields:
    """Mistral: the window (if any) applies to every layer."""
    window = cfg.get("sliding_window")
    return {"sliding_window": window, "layer_types": ("sliding",) * int(cfg["num_hidden_layers"])}


def _qwen_window(cfg: Mapping[str, Any]) -> Fields:
    """Qwen2/3: with use_sliding_window, layers from max_window_layers on slide (transformers' rule)."""
    if not cfg.get("use_sliding_window", False):
        return {"sliding_window": None}
    n, first = int(cfg["num_hidden_layers"]), int(cfg.get("max_window_layers", 28))
    return {"sliding_window": cfg.get("sliding_window"),
            "layer_types": tuple("sliding" if i >= first else "full" for i in range(n))}


def _qwen2_hf(cfg: Mapping[str, Any]) -> Fields:
    return {"qkv_bias": True, "o_bias": False} | _qwen_window(cfg)


def _qwen3_hf(cfg: Mapping[str, Any]) -> Fields:
    return {"qk_norm": True} | _qwen_window(cfg)


def _smollm3_hf(cfg: Mapping[str, Any]) -> Fields:
    """no_rope_layers[i] == 1 means layer i rotates; NoPE layers slide when use_sliding_window says so."""
    n = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("no_rope_layer_interval", 4))
    rotates = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    nope = tuple(i for i in range(n) if not rotates[i])
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    return {"no_rope_layers": nope, "sliding_window": window, "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
            "layer_types": tuple("sliding" if i in nope else "full" for i in range(n))}


def _smollm3_gguf(m: GGUFMeta) -> Fields:
    """llama.cpp hard-codes SmolLM3's NoPE step (every 4th layer) rather than writing it."""
    n = int(m.require("block_count"))
    return {"no_rope_layers": tuple(i for i in range(n) if (i + 1) % 4 == 0)}


# a "llama" GGUF with expert tensors is Mixtral: llama.cpp always renormalises its top-k weights
LLAMA = Family("llama", gguf_fields=lambda m: gguf_expert_fields(m, renormalize=True), gguf_permuted_qk=True)
MISTRAL = Family("mistral", hf_fields=_every_layer_slides)  # its GGUF is a "llama" file (no window key)
QWEN2 = Family("qwen2", hf_fields=_qwen2_hf, gguf_fields=lambda m: {"qkv_bias": True})
QWEN3 = Family("qwen3", hf_fields=_qwen3_hf, gguf_fields=lambda m: {"qk_norm": True})
SMOLLM3 = Family("smollm3", hf_fields=_smollm3_hf, gguf_fields=_smollm3_gguf, gguf_permuted_qk=True)
