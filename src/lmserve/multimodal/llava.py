"""LLaVA-1.5's preprocessing (transformers' CLIPImageProcessor and LlavaImageProcessor, PIL backend) and how many
`<image>` placeholders an image takes.

Shortest edge resized (bicubic), centre-cropped, rescaled, normalised with CLIP's statistics; LlavaImageProcessor's
`do_pad` first pads to a square of the mean colour (the original LLaVA's "expand2square").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .image_io import ImageData
from .processor import ProcessedImage
from .transforms import (
    BICUBIC,
    CLIP_MEAN,
    CLIP_STD,
    center_crop,
    pad_to_square,
    rescale_normalize,
    resize,
    shortest_edge_size,
    to_chw,
)


@dataclass(frozen=True)
class CLIPImageProcessor:
    """The fields of a CLIP/LLaVA preprocessor_config.json that change pixels (defaults: llava-1.5 at 336px)."""

    shortest_edge: int = 336
    crop: tuple[int, int] = (336, 336)  # (height, width)
    resample: int = BICUBIC
    do_resize: bool = True
    do_center_crop: bool = True
    do_pad: bool = False
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = CLIP_MEAN
    std: tuple[float, ...] | None = CLIP_STD

    @classmethod
    def from_hf(cls, d: dict) -> CLIPImageProcessor:
        """From a preprocessor_config.json's dict."""
        size, crop = d.get("size", {"shortest_edge": 224}), d.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            shortest_edge=size["shortest_edge"] if isinstance(size, dict) else size,
            crop=(crop["height"], crop["width"]), resample=d.get("resample", BICUBIC),
            do_resize=d.get("do_resize", True), do_center_crop=d.get("do_center_crop", True),
            do_pad=d.get("do_pad", False),
            rescale_factor=d.get("rescale_factor", 1 / 255) if d.get("do_rescale", True) else None,
            mean=tuple(d.get("image_mean", CLIP_MEAN)) if d.get("do_normalize", True) else None,
            std=tuple(d.get("image_std", CLIP_STD)) if d.get("do_normalize", True) else None)

    def pixels(self, image) -> np.ndarray:
        """One PIL image -> float32 [3, crop_h, crop_w]."""
        x = to_chw(image)
        if self.do_pad:
            x = pad_to_square(x, [int(m * 255) for m in (self.mean or (0, 0, 0))])
        if self.do_resize:
            x = resize(x, *shortest_edge_size(x.shape[1], x.shape[2], self.shortest_edge), self.resample)
        if self.do_center_crop:
            x = center_crop(x, *self.crop)
        return rescale_normalize(x, self.rescale_factor, self.mean, self.std)

    def preprocess(self, image: ImageData) -> dict[str, np.ndarray]:
        """{"pixel_values": float32 [1, 3, crop_h, crop_w]}."""
        return {"pixel_values": self.pixels(image.image)[None]}


def num_image_tokens(image_size: int, patch_size: int, select: str = "default") -> int:
    """Placeholders per image: one per patch, plus the CLS token unless the "default" strategy drops it."""
    return (image_size // patch_size) ** 2 + (select != "default")


def placeholder_text(image_size: int, patch_size: int, select: str = "default", image_token: str = "<image>") -> str:
    """The text one `<image>` in the prompt expands to (LlavaProcessor's expansion)."""
    return image_token * num_image_tokens(image_size, patch_size, select)


def placeholder_ids(image_token_id: int, image_size: int, patch_size: int, select: str = "default") -> list[int]:
    """The ids one `<image>` in the prompt expands to."""
    return [image_token_id] * num_image_tokens(image_size, patch_size, select)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass(frozen=True)
class LlavaProcessor:
    """LLaVA-1.5 for the engine (multimodal/processor.py): an image -> [1, 3, crop, crop] pixels and one
    `image_token` per patch embedding the tower returns."""

    pixels_of: CLIPImageProcessor
    image_size: int
    patch_size: int
    select: str = "default"
    image_token: str = "<image>"

    @classmethod
    def from_dir(cls, path: Path) -> LlavaProcessor:
        """From a model directory: preprocessor_config.json's pixels, config.json's tower geometry,
        processor_config.json's image token (llava-hf's defaults where a file or field is absent)."""
        cfg = _read_json(path / "config.json")
        vision = {"image_size": 224, "patch_size": 32} | (cfg.get("vision_config") or {})
        token = _read_json(path / "processor_config.json").get("image_token", "<image>")
        return cls(CLIPImageProcessor.from_hf(_read_json(path / "preprocessor_config.json")),
                   int(vision["image_size"]), int(vision["patch_size"]),
                   cfg.get("vision_feature_select_strategy", "default"), token)

    def process(self, image: Any) -> ProcessedImage:
        return ProcessedImage(self.pixels_of.pixels(image)[None], self.placeholder_for(image.width, image.height))

    def placeholder_for(self, width: int, height: int) -> str:
        return placeholder_text(self.image_size, self.patch_size, self.select, self.image_token)  # size-blind
