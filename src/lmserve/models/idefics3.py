"""Idefics3 / SmolVLM: a SigLIP vision tower, a pixel-shuffle connector and a Llama text model.

The text model is the shared CausalLM; this family adds `encode_images` (frames -> embeddings in the text model's
space, in the order of the image's placeholder tokens) and reads the wrapper's config.json and checkpoint names.
Which prompt positions the embeddings fill is the preprocessing's business (multimodal/idefics3.py) and placing
them the runner's (worker/mm_encoder.py): the model never sees a request.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from lmserve.models.config import ModelConfig, VisionConfig
from lmserve.models.decoder import CausalLM
from lmserve.models.family import Family, Fields, Tensors
from lmserve.models.vision.siglip import SiglipVisionTower

_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[frames, side*side, d] -> [frames, side*side / scale^2, d * scale^2]: each scale x scale block of patches
    becomes one vector (transformers' Idefics3Connector.pixel_shuffle, the same reshapes in the same order)."""
    b, n, d = x.shape
    side = int(n ** 0.5)
    x = x.view(b, side, side // scale, d * scale).permute(0, 2, 1, 3)
    x = x.reshape(b, side // scale, side // scale, d * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(b, n // (scale * scale), d * scale * scale)


class Projection(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v = cfg.vision
        self.proj = nn.Linear(v.hidden_size * v.scale_factor ** 2, cfg.hidden_size, bias=False)


class Connector(nn.Module):
    """Pixel shuffle, then a linear map into the text model's hidden size (HF's `connector`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.scale = cfg.vision.scale_factor
        self.modality_projection = Projection(cfg)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(features, self.scale))


class Idefics3LM(CausalLM):
    """CausalLM plus the vision tower and connector; `encode_images` is what the runner calls per image."""

    ENCODER_PREFIXES = ("vision_model.", "connector.")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.vision_model = SiglipVisionTower(cfg.vision)
        self.connector = Connector(cfg)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's frames [F, 3, S, S] -> its embeddings [F * image_seq_len, hidden], frame after frame."""
        dtype = self.vision_model.post_layernorm.weight.dtype  # a LayerNorm: no transform repacks it
        out = self.connector(self.vision_model(pixel_values.to(dtype)))  # [F, seq, hidden]
        return out.reshape(-1, out.shape[-1])


def _text_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config, carrying the vision tower's under `_vision` for `_hf_fields`."""
    text = dict(raw.get("text_config") or {})
    for key in ("tie_word_embeddings",):
        if key in raw:
            text[key] = raw[key]
    text["_vision"] = dict(raw.get("vision_config") or {}, scale_factor=raw.get("scale_factor", 2),
                           image_token_id=raw.get("image_token_id"))
    return text


def _hf_fields(cfg: Mapping[str, Any]) -> Fields:
    v, d = cfg["_vision"], VisionConfig()
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _ACTS:
        raise ValueError(f"vision_config.hidden_act {act!r} is not supported")
    return {"vision": VisionConfig(
        hidden_size=int(v.get("hidden_size", d.hidden_size)), intermediate_size=int(v.get("intermediate_size", d.intermediate_size)),
        num_layers=int(v.get("num_hidden_layers", d.num_layers)), num_heads=int(v.get("num_attention_heads", d.num_heads)),
        image_size=int(v.get("image_size", d.image_size)), patch_size=int(v.get("patch_size", d.patch_size)),
        num_channels=int(v.get("num_channels", 3)), layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        hidden_act=_ACTS[act], scale_factor=int(v["scale_factor"]),
        image_token_id=None if v.get("image_token_id") is None else int(v["image_token_id"]))}


_RENAMES = (("model.text_model.", "model."), ("model.vision_model.", "vision_model."),
            ("model.connector.", "connector."), ("lm_head.", "lm_head."))


def _checkpoint_tensors(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Tensors:
    """HF's wrapper names -> Idefics3LM's: the text model under `model.`, the tower and connector at the top."""
    for prefix, new in _RENAMES:
        if name.startswith(prefix):
            yield new + name[len(prefix):], tensor
            return
    yield name, tensor  # an unexpected tensor: load_weights names it


IDEFICS3 = Family("idefics3", hf_fields=_hf_fields, text_config=_text_config, checkpoint_tensors=_checkpoint_tensors,
                  model=Idefics3LM)
