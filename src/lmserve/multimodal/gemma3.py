"""Gemma 3's preprocessing (transformers' Gemma3ImageProcessor, PIL backend; pan-and-scan when the config turns it on)
and its image token span.

The image is squashed to 896x896 (bilinear, aspect ratio not kept), rescaled and normalised to [-1, 1]. In the
prompt, each `<start_of_image>` becomes "\\n\\n<start_of_image>" + 256 `<image_soft_token>` + "<end_of_image>\\n\\n"
(transformers' Gemma3Processor.full_image_sequence); the soft tokens are where the 256 embeddings go. Pan-and-scan
(off unless `do_pan_and_scan`) adds 2..max_crops crops of a very wide or tall image after the whole view, each
encoded as an image of its own (`image_text` writes the longer span).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .image_io import ImageData
from .processor import ProcessedImage
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
    pan_and_scan: bool = False
    pas_min_crop: int = 256
    pas_max_crops: int = 4
    pas_min_ratio: float = 1.2

    @classmethod
    def from_hf(cls, d: dict) -> Gemma3ImageProcessor:
        """From a preprocessor_config.json's dict."""
        size = d.get("size", {"height": 224, "width": 224})
        norm = d.get("do_normalize", True)
        return cls(size=(size["height"], size["width"]), resample=d.get("resample", BILINEAR),
                   rescale_factor=d.get("rescale_factor", 1 / 255) if d.get("do_rescale", True) else None,
                   mean=tuple(d.get("image_mean", HALF)) if norm else None,
                   std=tuple(d.get("image_std", HALF)) if norm else None,
                   pan_and_scan=bool(d.get("do_pan_and_scan")),
                   pas_min_crop=d.get("pan_and_scan_min_crop_size") or 256,
                   pas_max_crops=d.get("pan_and_scan_max_num_crops") or 4,
                   pas_min_ratio=d.get("pan_and_scan_min_ratio_to_activate") or 1.2)

    def crops(self, chw: np.ndarray) -> list[np.ndarray]:
        """Pan-and-scan's crops of a [3, H, W] image: 2..max_crops along its long side when it is at least
        min_ratio times the short one and each crop stays min_crop or larger; none otherwise."""
        _, h, w = chw.shape
        long, short = max(h, w), min(h, w)
        if not self.pan_and_scan or long / short < self.pas_min_ratio:
            return []
        n = min(self.pas_max_crops, max(2, min(math.floor(long / self.pas_min_crop), math.floor(long / short + 0.5))))
        rows, cols = (1, n) if w >= h else (n, 1)
        ch, cw = math.ceil(h / rows), math.ceil(w / cols)
        if min(ch, cw) < self.pas_min_crop:
            return []
        return [chw[:, i * ch:(i + 1) * ch, j * cw:(j + 1) * cw] for i in range(rows) for j in range(cols)]

    def pixels(self, chw: np.ndarray) -> np.ndarray:
        """One uint8 [3, H, W] view -> float32 [3, height, width]."""
        return rescale_normalize(resize(chw, *self.size, self.resample), self.rescale_factor, self.mean, self.std)

    def preprocess(self, image: ImageData) -> dict[str, np.ndarray]:
        """{"pixel_values": float32 [1 + crops, 3, height, width] (the whole image first), "num_crops": [crops]}."""
        chw = to_chw(image.image)
        views = [chw, *self.crops(chw)]
        return {"pixel_values": np.stack([self.pixels(v) for v in views]),
                "num_crops": np.array([len(views) - 1], dtype=np.int64)}


def image_sequence(tokens_per_image: int = 256) -> str:
    """The text one `<start_of_image>` in a prompt expands to (Gemma3Processor.full_image_sequence)."""
    return f"\n\n{BOI}{IMAGE * tokens_per_image}{EOI}\n\n"


def image_text(num_crops: int = 0, tokens_per_image: int = 256) -> str:
    """What replaces one `<start_of_image>` (Gemma3Processor.replace_image_token): the image's span, and with
    pan-and-scan crops, a sentence introducing one span per crop."""
    one = image_sequence(tokens_per_image)
    if not num_crops:
        return one
    return (f"Here is the original image {one} and here are some crops to help you see better "
            + " ".join([one] * num_crops))


def placeholder_ids(boi_id: int, image_id: int, eoi_id: int, tokens_per_image: int = 256) -> list[int]:
    """The image span's ids: `<start_of_image>`, the soft tokens, `<end_of_image>` (the "\\n\\n" around it are text)."""
    return [boi_id, *[image_id] * tokens_per_image, eoi_id]


@dataclass(frozen=True)
class Gemma3Processor:
    """Gemma 3 for the engine (multimodal/processor.py): the prompt marks an image with `<start_of_image>`
    (`image_token`), which expands to a span whose `<image_soft_token>`s (`embed_token`) take the embeddings; the
    soft tokens attend to each other both ways (`bidirectional`). Pan-and-scan's crops are not offered: each image
    is its whole view (the default of every Gemma 3 checkpoint's preprocessor_config.json)."""

    pixels_of: Gemma3ImageProcessor
    tokens_per_image: int = 256
    image_token = BOI
    embed_token = IMAGE
    bidirectional = True

    @classmethod
    def from_dir(cls, path: Path) -> Gemma3Processor:
        def read(name: str) -> dict:
            return json.loads((path / name).read_text()) if (path / name).is_file() else {}
        pre = read("preprocessor_config.json") | {"do_pan_and_scan": False}
        return cls(Gemma3ImageProcessor.from_hf(pre), int(read("config.json").get("mm_tokens_per_image", 256)))

    def process(self, image: Any) -> ProcessedImage:
        return ProcessedImage(self.pixels_of.pixels(to_chw(image))[None], image_sequence(self.tokens_per_image))

    def placeholder_for(self, width: int, height: int) -> str:
        return image_sequence(self.tokens_per_image)  # every image is one view of the tower's size
