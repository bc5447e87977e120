"""LLaVA-1.5's preprocessing (transformers' CLIPImageProcessor and LlavaImageProcessor, PIL backend) and how many
`<image>` placeholders an image takes.

Shortest edge resized (bicubic), centre-cropped, rescaled, normalised with CLIP's statistics; LlavaImageProcessor's
`do_pad` first pads to a square of the mean colour (the original LLaVA's "expand2square").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .image_io import ImageData
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
