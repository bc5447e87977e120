"""Architecture name -> model class. One Llama-family implementation serves them all."""

from __future__ import annotations

from torch import nn

from lmserve.models.config import ModelConfig
from lmserve.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


def build_model(cfg: ModelConfig) -> nn.Module:
    """Instantiate the class registered for the config's architecture."""
    return MODEL_REGISTRY[cfg.architecture](cfg)
