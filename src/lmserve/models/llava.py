"""LLaVA-1.5: a CLIP vision tower read at a middle layer, a 2-layer MLP projector and a Llama text model.

The text model is the shared CausalLM; this family adds `encode_images` (one image's pixels -> its embeddings in
the text model's space, one per `<image>` placeholder) over the pure tower in models/vision/llava.py, and reads the
wrapper's config.json and checkpoint names (transformers 4's `language_model.model.*` and 5's
`model.language_model.*`). Which prompt positions the embeddings fill is multimodal/llava.py's business.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lmserve.models.config import ModelConfig, VisionConfig
from lmserve.models.decoder import CausalLM
from lmserve.models.family import Family, Fields, Tensors
from lmserve.models.vision.llava import DROP, PREFIXES, LlavaNextVision, LlavaVision, LlavaVisionConfig
from lmserve.models.vision.vit import ACTIVATIONS, ViTConfig
from lmserve.models.vision.weights import vision_state

# CLIPVisionConfig's defaults: llava-hf's config.json names only the fields that differ from them
_CLIP = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
         "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}


def tower_config(cfg: ModelConfig) -> LlavaVisionConfig:
    """The pure tower's config from ModelConfig.vision (what `_hf_fields` read)."""
    v = cfg.vision
    vit = ViTConfig(v.hidden_size, v.intermediate_size, v.num_layers, v.num_heads, v.hidden_act, v.layer_norm_eps)
    return LlavaVisionConfig(vit, v.image_size, v.patch_size, cfg.hidden_size, v.feature_layers, v.feature_select,
                             v.projector_act, v.projector_bias)


class LlavaLM(CausalLM):
    """CausalLM plus LLaVA's tower and projector (under `vision.`); `encode_images` is what the runner calls."""

    ENCODER_PREFIXES = ("vision.",)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.vision = LlavaVision(tower_config(cfg))

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's pixels [1, 3, S, S] -> its embeddings [tokens_per_image, hidden] (the tower answers per
        image in a batch; the runner wants one tensor for the image)."""
        dtype = self.vision.vision_tower.pre_layrnorm.weight.dtype  # a LayerNorm: no transform repacks it
        return torch.cat(self.vision.encode_images(pixel_values.to(dtype)))


class LlavaNextLM(LlavaLM):
    """LLaVA-NeXT: LLaVA's tower and projector over a base view and anyres tiles, unpadded, rows ended by
    `image_newline` (under `vision.` too)."""

    def __init__(self, cfg: ModelConfig) -> None:
        CausalLM.__init__(self, cfg)
        self.vision = LlavaNextVision(tower_config(cfg))

    def encode_images(self, pixel_values: torch.Tensor, image_size: tuple[int, int] = (0, 0),
                      tile_grid: tuple[int, int] = (1, 1)) -> torch.Tensor:
        """One image's views [1 + rows*cols, 3, tile, tile], its (height, width) and tile grid (the processor's
        meta) -> its embeddings [base patches + unpadded rows * (cols + 1), hidden]."""
        dtype = self.vision.vision_tower.pre_layrnorm.weight.dtype
        return self.vision.encode_images([pixel_values.to(dtype)], [tuple(image_size)], [tuple(tile_grid)])[0]


def _text_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config, carrying the tower's and projector's settings under `_vision` for `_hf_fields`."""
    text = dict(raw.get("text_config") or {})
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    layer = raw.get("vision_feature_layer", -2)
    text["_vision"] = dict(_CLIP | dict(raw.get("vision_config") or {}),
                           feature_layers=[layer] if isinstance(layer, int) else list(layer),
                           feature_select=raw.get("vision_feature_select_strategy", "default"),
                           projector_act=raw.get("projector_hidden_act", "gelu"),
                           projector_bias=raw.get("multimodal_projector_bias", True),
                           image_token_id=raw.get("image_token_id", raw.get("image_token_index")))
    return text


def _hf_fields(cfg: Mapping[str, Any]) -> Fields:
    v = cfg["_vision"]
    for act in (v["hidden_act"], v["projector_act"]):
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported")
    if v["feature_select"] not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy {v['feature_select']!r} is not supported")
    return {"vision": VisionConfig(
        hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
        num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
        image_size=int(v["image_size"]), patch_size=int(v["patch_size"]), num_channels=int(v.get("num_channels", 3)),
        layer_norm_eps=float(v["layer_norm_eps"]), hidden_act=v["hidden_act"],
        image_token_id=None if v.get("image_token_id") is None else int(v["image_token_id"]),
        feature_layers=tuple(int(i) for i in v["feature_layers"]), feature_select=v["feature_select"],
        projector_act=v["projector_act"], projector_bias=bool(v["projector_bias"]))}


_TEXT = (("model.language_model.", "model."), ("language_model.model.", "model."),
         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def _checkpoint_tensors(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Tensors:
    """HF's wrapper names -> LlavaLM's: the text model under `model.`, the tower's (models/vision/weights.py's
    normalisation) under `vision.`; CLIP's post-layernorm, which LLaVA never reads, is dropped."""
    for prefix, new in _TEXT:
        if name.startswith(prefix):
            yield new + name[len(prefix):], tensor
            return
    if any(d in name for d in DROP):
        return
    kept = vision_state({name: tensor}, PREFIXES, DROP)
    if kept:
        yield from (("vision." + k, t) for k, t in kept.items())
        return
    yield name, tensor  # an unexpected tensor: load_weights names it


LLAVA = Family("llava", hf_fields=_hf_fields, text_config=_text_config, checkpoint_tensors=_checkpoint_tensors,
               model=LlavaLM)
LLAVA_NEXT = Family("llava_next", hf_fields=_hf_fields, text_config=_text_config,
                    checkpoint_tensors=_checkpoint_tensors, model=LlavaNextLM)
