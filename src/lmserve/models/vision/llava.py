"""LLaVA-1.5's image path: CLIP hidden states at the feature layer(s), CLS dropped, then a 2-layer GELU MLP.

`LlavaVision.encode_images(pixel_values)` gives one [tokens_per_image, text_hidden] tensor per image (576 for
LLaVA-1.5's 336px CLIP-L/14). Parameter names follow transformers' LlavaModel (`vision_tower.*`,
`multi_modal_projector.linear_1/linear_2`), so the checkpoint's `model.` prefix is the only thing to strip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .clip import CLIPVisionTower
from .vit import ACTIVATIONS, ViTConfig


@dataclass(frozen=True)
class LlavaVisionConfig:
    """What LLaVA's image path needs from a LlavaConfig."""

    vision: ViTConfig
    image_size: int
    patch_size: int
    text_hidden: int
    feature_layers: tuple[int, ...] = (-2,)
    select: str = "default"  # "default" drops the CLS token, "full" keeps it
    projector_act: str = "gelu"
    projector_bias: bool = True

    @classmethod
    def from_hf(cls, config) -> LlavaVisionConfig:
        """From a transformers LlavaConfig."""
        vc, layer = config.vision_config, config.vision_feature_layer
        return cls(ViTConfig.from_hf(vc), vc.image_size, vc.patch_size, config.text_config.hidden_size,
                   (layer,) if isinstance(layer, int) else tuple(layer), config.vision_feature_select_strategy,
                   config.projector_hidden_act, getattr(config, "multimodal_projector_bias", True))

    @property
    def tokens_per_image(self) -> int:
        """How many `<image>` placeholders one image expands to."""
        return (self.image_size // self.patch_size) ** 2 + (self.select == "full")


class LlavaMultiModalProjector(nn.Module):
    """linear_1 -> activation -> linear_2, from the vision width (times feature layers) to the text width."""

    def __init__(self, cfg: LlavaVisionConfig):
        super().__init__()
        width = cfg.vision.hidden_size * len(cfg.feature_layers)
        self.linear_1 = nn.Linear(width, cfg.text_hidden, bias=cfg.projector_bias)
        self.act = ACTIVATIONS[cfg.projector_act]
        self.linear_2 = nn.Linear(cfg.text_hidden, cfg.text_hidden, bias=cfg.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVision(nn.Module):
    """CLIP tower + projector: pixel values in, text-model embeddings per image out."""

    def __init__(self, cfg: LlavaVisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = CLIPVisionTower(cfg.vision, cfg.image_size, cfg.patch_size)
        self.multi_modal_projector = LlavaMultiModalProjector(cfg)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, tokens_per_image, vision_hidden * feature layers]: the selected layers, CLS dropped by default."""
        states = self.vision_tower(pixel_values, self.cfg.feature_layers)
        if self.cfg.select == "default":
            states = [s[:, 1:] for s in states]
        return torch.cat(states, dim=-1)

    def encode_images(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [images, 3, size, size] -> one [tokens_per_image, text_hidden] tensor per image."""
        return list(self.multi_modal_projector(self.image_features(pixel_values)))
