"""Gemma 3's preprocessing (transformers' Gemma3ImageProcessor, PIL backend, pan-and-scan off as by default) and its
image token span.

The image is squashed to 896x896 (bilinear, aspect ratio not kept), rescaled and normalised to [-1, 1]. In the
prompt, each `<start_of_image>` becomes "\\n\\n<start_of_image>" + 256 `<image_soft_token>` + "<end_of_image>\\n\\n"
(transformers' Gemma3Processor.full_image_sequence); the soft tokens are where the 256 embeddings go.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .image_io import ImageData
from .transforms import BILINEAR, HALF, rescale_normalize, resize, to_chw

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    """The fields of Gemma 3's preprocessor_config.json that change pixels."""

    size: tuple[int, int] = (896, 896)  # (height, width)
    resample: int = BILINEAR
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = HALF
    std: tuple[float, ...] | None = HALF

    @classmethod
    def from_hf(cls, d: dict) -> Gemma3ImageProcessor:
        """From a preprocessor_config.json's dict; refuses pan-and-scan, which this processor does not do."""
        if d.get("do_pan_and_scan"):
            raise ValueError("Gemma 3 pan-and-scan is not supported")
        size = d.get("size", {"height": 224, "width": 224})
        norm = d.get("do_normalize", True)
        return cls(size=(size["height"], size["width"]), resample=d.get("resample", BILINEAR),
                   rescale_factor=d.get("rescale_factor", 1 / 255) if d.get("do_rescale", True) else None,
                   mean=tuple(d.get("image_mean", HALF)) if norm else None,
                   std=tuple(d.get("image_std", HALF)) if norm else None)

    def pixels(self, image) -> np.ndarray:
        """One PIL image -> float32 [3, height, width]."""
        return rescale_normalize(resize(to_chw(image), *self.size, self.resample), self.rescale_factor, self.mean,
                                 self.std)

    def preprocess(self, image: ImageData) -> dict[str, np.ndarray]:
        """{"pixel_values": float32 [1, 3, height, width], "num_crops": [0]}."""
        return {"pixel_values": self.pixels(image.image)[None], "num_crops": np.zeros(1, dtype=np.int64)}


def image_sequence(tokens_per_image: int = 256) -> str:
    """The text one `<start_of_image>` in a prompt expands to (Gemma3Processor.full_image_sequence)."""
    return f"\n\n{BOI}{IMAGE * tokens_per_image}{EOI}\n\n"


def placeholder_ids(boi_id: int, image_id: int, eoi_id: int, tokens_per_image: int = 256) -> list[int]:
    """The image span's ids: `<start_of_image>`, the soft tokens, `<end_of_image>` (the "\\n\\n" around it are text)."""
    return [boi_id, *[image_id] * tokens_per_image, eoi_id]
