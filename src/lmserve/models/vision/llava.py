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
from .weights import load_vision

# checkpoint prefix -> module prefix; CLIP's post-layernorm feeds only its pooled output, which LLaVA never reads
PREFIXES = {"vision_tower.": "vision_tower.", "multi_modal_projector.": "multi_modal_projector.",
            "image_newline": "image_newline"}
DROP = ("post_layernorm.", "position_ids")


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

    def load_hf_weights(self, tensors) -> None:
        """Load from a LLaVA(-NeXT) checkpoint's tensors (name -> tensor; the text model's are ignored)."""
        load_vision(self, tensors, PREFIXES, DROP)


def unpad_features(features: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[hidden, rows, cols] tile features -> the rows or columns an image of height x width filled (transformers'
    unpad_image: the padding the processor centred the image on is cut, rounded the same way)."""
    _, rows, cols = features.shape
    if width / height > cols / rows:
        pad = (rows - int(round(height * (cols / width), 7))) // 2
        return features[:, pad:rows - pad]
    pad = (cols - int(round(width * (rows / height), 7))) // 2
    return features[:, :, pad:cols - pad]


class LlavaNextVision(LlavaVision):
    """LLaVA-NeXT: LLaVA's tower and projector over a base view plus anyres tiles, packed with row newlines."""

    def __init__(self, cfg: LlavaVisionConfig):
        super().__init__(cfg)
        self.image_newline = nn.Parameter(torch.zeros(cfg.text_hidden))

    def encode_images(self, pixel_values: list[torch.Tensor], image_sizes: list[tuple[int, int]],
                      tile_grids: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Per image: views [1 + rows*cols, 3, tile, tile] (the processor's), its (height, width) and its tile grid
        (rows, cols) -> [base patches + unpadded rows * (cols + 1), text_hidden]."""
        counts = [v.shape[0] for v in pixel_values]
        feats = self.multi_modal_projector(self.image_features(torch.cat(pixel_values))).split(counts)
        return [self._pack(f, size, grid) for f, size, grid in zip(feats, image_sizes, tile_grids)]

    def _pack(self, f: torch.Tensor, size: tuple[int, int], grid: tuple[int, int]) -> torch.Tensor:
        side = self.cfg.image_size // self.cfg.patch_size
        rows, cols = grid
        tiles = f[1:, -side * side:]  # the "full" strategy's CLS token has no place in the tile map
        tiles = tiles.view(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3).reshape(-1, rows * side, cols * side)
        tiles = unpad_features(tiles, *size)  # [hidden, h', w']
        newline = self.image_newline[:, None, None].expand(-1, tiles.shape[1], 1).to(tiles.dtype)
        packed = torch.cat([tiles, newline], dim=-1).flatten(1).T  # [h' * (w' + 1), hidden]
        return torch.cat([f[0], packed])
