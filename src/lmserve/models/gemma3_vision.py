"""Gemma 3 with its images: a SigLIP tower pooled to soft tokens (models/vision/gemma3.py) beside Gemma 3's text model.

The text model is the shared CausalLM read as models/gemma.py reads Gemma 3; this family adds `encode_images` and
the tower's settings and tensor names. Bidirectional attention among an image's soft tokens is not the model's
business: the processor marks its images `bidirectional` and the runner hands their spans to attention.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lmserve.models import gemma
from lmserve.models.config import ModelConfig, VisionConfig
from lmserve.models.decoder import CausalLM
from lmserve.models.family import Family, Fields, Tensors
from lmserve.models.vision.gemma3 import DROP, PREFIXES, Gemma3Vision, Gemma3VisionConfig
from lmserve.models.vision.vit import ACTIVATIONS, ViTConfig
from lmserve.models.vision.weights import vision_state

# SiglipVisionConfig's defaults (Gemma 3's config.json names only what differs)
_SIGLIP = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
           "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}


class Gemma3VisionLM(CausalLM):
    """CausalLM plus Gemma 3's tower and projector (under `vision.`)."""

    ENCODER_PREFIXES = ("vision.",)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        v = cfg.vision
        vit = ViTConfig(v.hidden_size, v.intermediate_size, v.num_layers, v.num_heads, v.hidden_act, v.layer_norm_eps)
        self.vision = Gemma3Vision(Gemma3VisionConfig(vit, v.image_size, v.patch_size, cfg.hidden_size,
                                                      v.tokens_per_image or 256))

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image [1, 3, S, S] -> its soft-token embeddings [tokens_per_image, hidden]."""
        dtype = self.vision.vision_tower.post_layernorm.weight.dtype  # a LayerNorm: no transform repacks it
        return torch.cat(self.vision.encode_images(pixel_values.to(dtype)))


def _text_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    text = dict(gemma._text_config(raw))
    text["_vision"] = dict(_SIGLIP | dict(raw.get("vision_config") or {}),
                           tokens_per_image=raw.get("mm_tokens_per_image", 256))
    return text


def _hf_fields(cfg: Mapping[str, Any]) -> Fields:
    v = cfg["_vision"]
    if v["hidden_act"] not in ACTIVATIONS:
        raise ValueError(f"vision_config.hidden_act {v['hidden_act']!r} is not supported")
    return gemma._gemma3_hf(cfg) | {"vision": VisionConfig(
        hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
        num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
        image_size=int(v["image_size"]), patch_size=int(v["patch_size"]), layer_norm_eps=float(v["layer_norm_eps"]),
        hidden_act=v["hidden_act"], tokens_per_image=int(v["tokens_per_image"]))}


def _checkpoint_tensors(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Tensors:
    """The language model's tensors as models/gemma.py names them; the tower's and projector's under `vision.`."""
    text = list(gemma._language_model(name, tensor, cfg))
    if text:
        yield from text
        return
    if any(d in name.removeprefix("model.").replace("vision_model.", "") for d in DROP):
        return
    kept = vision_state({name: tensor}, PREFIXES, DROP)
    yield from ((("vision." + k, t) for k, t in kept.items()) if kept else [(name, tensor)])


GEMMA3_VISION = Family("gemma3", hf_fields=_hf_fields, text_config=_text_config,
                       checkpoint_tensors=_checkpoint_tensors, model=Gemma3VisionLM)
