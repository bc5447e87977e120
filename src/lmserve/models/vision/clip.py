"""CLIP's vision tower (LLaVA's image encoder): a class token and learned positions before a pre-LayerNorm ViT.

LLaVA reads a middle layer (feature layer -2), so `forward` runs only as many layers as the deepest one asked for.
Parameter names follow transformers' CLIPVisionModel (`embeddings.patch_embedding`, `pre_layrnorm`, `encoder.layers`).
"""

from __future__ import annotations

import torch
from torch import nn

from .vit import ViTConfig, ViTEncoder


class CLIPVisionEmbeddings(nn.Module):
    """Patches by a stride-p convolution, a class token in front, a learned position per token."""

    def __init__(self, hidden: int, image_size: int, patch_size: int, channels: int = 3):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(hidden))
        self.patch_embedding = nn.Conv2d(channels, hidden, kernel_size=patch_size, stride=patch_size, bias=False)
        self.position_embedding = nn.Embedding((image_size // patch_size) ** 2 + 1, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [images, patches, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionTower(nn.Module):
    """CLIP ViT; `forward` returns the hidden states LLaVA selects (transformers' `hidden_states` indexing)."""

    def __init__(self, cfg: ViTConfig, image_size: int, patch_size: int):
        super().__init__()
        self.image_size, self.patch_size = image_size, patch_size
        self.embeddings = CLIPVisionEmbeddings(cfg.hidden_size, image_size, patch_size)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)
        self.encoder = ViTEncoder(cfg)

    def forward(self, pixel_values: torch.Tensor, layers: tuple[int, ...]) -> list[torch.Tensor]:
        """The hidden states at `layers` (index 0 = embeddings, -1 = last layer), each [images, 1 + patches, hidden]."""
        total = len(self.encoder.layers) + 1
        idx = [i % total for i in layers]
        states = self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)), keep=max(idx))
        return [states[i] for i in idx]

