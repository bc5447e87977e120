"""Gemma 3's image path: a SigLIP ViT at 896px (64x64 patches), average-pooled to 256 soft tokens, Gemma-RMSNorm'd and
projected to the text width.

`Gemma3Vision.encode_images(pixel_values)` gives one [mm_tokens_per_image, text_hidden] tensor per image. The tower
is SigLIP (patch conv + learned positions, no class token, the pre-norm ViT of vit.py, a final LayerNorm); it is
named `Gemma3VisionTower` here so it stays apart from models/vision/siglip.py (SmolVLM's, written alongside), which
may replace it. Parameter names follow transformers' Gemma3Model (`vision_tower.*` minus its `vision_model.` level,
`multi_modal_projector.mm_input_projection_weight`, `multi_modal_projector.mm_soft_emb_norm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .vit import ViTConfig, ViTEncoder
from .weights import load_vision

PREFIXES = {"vision_tower.": "vision_tower.", "multi_modal_projector.": "multi_modal_projector."}
DROP = ("vision_tower.head.", "position_ids")  # SigLIP's pooling head: Gemma 3 reads the patch states


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """What Gemma 3's image path needs from a Gemma3Config."""

    vision: ViTConfig
    image_size: int
    patch_size: int
    text_hidden: int
    tokens_per_image: int = 256

    @classmethod
    def from_hf(cls, config) -> Gemma3VisionConfig:
        """From a transformers Gemma3Config."""
        vc = config.vision_config
        return cls(ViTConfig.from_hf(vc), vc.image_size, vc.patch_size, config.text_config.hidden_size,
                   config.mm_tokens_per_image)


class SiglipPatchEmbeddings(nn.Module):
    """Patches by a stride-p convolution plus a learned position per patch (no class token)."""

    def __init__(self, hidden: int, image_size: int, patch_size: int, channels: int = 3):
        super().__init__()
        self.patch_embedding = nn.Conv2d(channels, hidden, kernel_size=patch_size, stride=patch_size)
        self.position_embedding = nn.Embedding((image_size // patch_size) ** 2, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight  # [images, patches, hidden]


class Gemma3VisionTower(nn.Module):
    """SigLIP's vision transformer: embeddings -> encoder -> post_layernorm; returns the last hidden state."""

    def __init__(self, cfg: ViTConfig, image_size: int, patch_size: int):
        super().__init__()
        self.embeddings = SiglipPatchEmbeddings(cfg.hidden_size, image_size, patch_size)
        self.encoder = ViTEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, size, size] -> [images, patches, vision_hidden]."""
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values))[-1])


class Gemma3MultiModalProjector(nn.Module):
    """Average-pool the patch grid to tokens_per_image, RMSNorm (weight stored as w - 1), matmul to the text width."""

    def __init__(self, cfg: Gemma3VisionConfig):
        super().__init__()
        self.patches_per_side = cfg.image_size // cfg.patch_size
        self.kernel = self.patches_per_side // int(cfg.tokens_per_image ** 0.5)
        self.eps = cfg.vision.eps
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(cfg.vision.hidden_size, cfg.text_hidden))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(cfg.vision.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape  # [images, patches, vision_hidden]
        grid = x.transpose(1, 2).reshape(b, d, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [images, tokens, hidden]
        p = pooled.float()
        normed = p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = normed * (1.0 + self.mm_soft_emb_norm.weight.float())
        return (normed.type_as(x) @ self.mm_input_projection_weight).type_as(x)


class Gemma3Vision(nn.Module):
    """SigLIP tower + projector: pixel values in, 256 soft-token embeddings per image out."""

    def __init__(self, cfg: Gemma3VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = Gemma3VisionTower(cfg.vision, cfg.image_size, cfg.patch_size)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg)

    def encode_images(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [images, 3, size, size] -> one [tokens_per_image, text_hidden] tensor per image."""
        return list(self.multi_modal_projector(self.vision_tower(pixel_values)))

    def load_hf_weights(self, tensors) -> None:
        """Load from a Gemma 3 checkpoint's tensors (name -> tensor; the text model's are ignored)."""
        load_vision(self, tensors, PREFIXES, DROP)

