"""The image operations Hugging Face's PIL image processors are made of, in Pillow and numpy, step for step.

Each matches transformers' `image_transforms` numerics: resize on the uint8 image with Pillow, crop and pad in
channel-first numpy, rescale through float64 to float32, normalise in float32. Arrays are [channels, height, width].
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's statistics (transformers' OPENAI_CLIP_MEAN/STD)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_MEAN/STD: SigLIP, Gemma 3

# Pillow's filter numbers, as the `resample` field of a preprocessor_config.json spells them.
NEAREST, BILINEAR, BICUBIC, LANCZOS = 0, 2, 3, 1


def to_chw(image) -> np.ndarray:
    """A PIL RGB image as a uint8 [3, H, W] array."""
    return np.moveaxis(np.asarray(image.convert("RGB")), -1, 0)


def resize(chw: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """Resize a uint8 [C, H, W] image with Pillow (transformers resizes PIL images the same way)."""
    from PIL import Image

    img = Image.fromarray(np.ascontiguousarray(np.moveaxis(chw, 0, -1)))
    return np.moveaxis(np.asarray(img.resize((width, height), resample=resample)), -1, 0)


def shortest_edge_size(height: int, width: int, shortest: int) -> tuple[int, int]:
    """(height, width) with the short side at `shortest` and the long one scaled down to an int (truncated)."""
    if width <= height:
        return int(shortest * height / width), shortest
    return shortest, int(shortest * width / height)


def center_crop(chw: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centred height x width window; zero padding (centred, rounding up) where the image is smaller."""
    _, h, w = chw.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return chw[:, top:top + height, left:left + width]
    nh, nw = max(height, h), max(width, w)
    out = np.zeros((chw.shape[0], nh, nw), dtype=chw.dtype)
    tp, lp = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
    out[:, tp:tp + h, lp:lp + w] = chw
    top, left = (nh - height) // 2, (nw - width) // 2
    return out[:, top:top + height, left:left + width]


def pad_to_square(chw: np.ndarray, color: Sequence[int]) -> np.ndarray:
    """Pad the short side on both ends (the extra pixel after) to a square filled with `color` per channel."""
    c, h, w = chw.shape
    if h == w:
        return chw
    side = max(h, w)
    out = np.empty((c, side, side), dtype=chw.dtype)
    out[:] = np.asarray(color, dtype=chw.dtype)[:, None, None]
    if w > h:
        out[:, (side - h) // 2:(side - h) // 2 + h] = chw
    else:
        out[:, :, (side - w) // 2:(side - w) // 2 + w] = chw
    return out


def rescale_normalize(chw: np.ndarray, scale: float | None, mean: Sequence[float] | None,
                      std: Sequence[float] | None) -> np.ndarray:
    """float32 (x * scale - mean) / std; either step skipped when its arguments are None."""
    x = chw.astype(np.float64) * scale if scale is not None else chw
    x = x.astype(np.float32)
    if mean is not None:
        m = np.asarray(mean, dtype=np.float32)[:, None, None]
        s = np.asarray(std, dtype=np.float32)[:, None, None]
        x = (x - m) / s
    return x
