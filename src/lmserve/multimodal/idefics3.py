"""Idefics3 / SmolVLM preprocessing: an image -> tiles of the vision size plus a global view, and the text that
stands in for it in the prompt. Equal to transformers' Idefics3ImageProcessor (its Pillow backend) and
Idefics3Processor: pixel values within 1e-6 (tests/test_vision_preprocess.py), the same placeholder text.

The steps, as transformers runs them (each Pillow resize is LANCZOS on the uint8 image, so the order matters):
1. resize so the longest edge is `longest_edge` (the short one even, both at most 4096);
2. with splitting, resize up to multiples of the tile size, cut row-major tiles, and add the whole image resized to
   one tile (the global view); an image already one tile is kept alone (rows = cols = 0); without splitting, resize
   to one tile;
3. rescale (float64 multiply, then float32) and normalise per channel in float32.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from lmserve.multimodal.processor import ProcessedImage

MAX_IMAGE_SIZE = 4096  # transformers' cap on either side after the first resize
LANCZOS = 1  # PIL.Image.Resampling.LANCZOS, transformers' default for Idefics3
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TAG = "<global-img>"
IMAGE_TOKEN = "<image>"


@dataclass(frozen=True)
class Idefics3Config:
    """The image processor's settings (preprocessor_config.json) and the processor's image_seq_len."""

    longest_edge: int = 4 * 364  # size["longest_edge"]: the first resize
    tile: int = 364  # max_image_size["longest_edge"]: the vision encoder's image size
    do_image_splitting: bool = True
    resample: int = LANCZOS
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_seq_len: int = 169  # embeddings per tile: (tile / patch)^2 / scale_factor^2

    @classmethod
    def from_dicts(cls, pre: Mapping[str, Any], proc: Mapping[str, Any] | None = None) -> Idefics3Config:
        """From preprocessor_config.json's dict and processor_config.json's (image_seq_len), defaults where absent."""
        d = cls()
        return cls(longest_edge=int((pre.get("size") or {}).get("longest_edge", d.longest_edge)),
                   tile=int((pre.get("max_image_size") or {}).get("longest_edge", d.tile)),
                   do_image_splitting=bool(pre.get("do_image_splitting", d.do_image_splitting)),
                   resample=int(pre.get("resample", d.resample)),
                   rescale_factor=float(pre.get("rescale_factor", d.rescale_factor)),
                   image_mean=tuple(pre.get("image_mean", d.image_mean)),
                   image_std=tuple(pre.get("image_std", d.image_std)),
                   image_seq_len=int((proc or {}).get("image_seq_len", d.image_seq_len)))

    @classmethod
    def from_dir(cls, path: Path) -> Idefics3Config:
        """Read from a model directory (files absent: SmolVLM's defaults)."""
        pre, proc = (_read_json(path / name) for name in ("preprocessor_config.json", "processor_config.json"))
        return cls.from_dicts(pre, proc)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _fit_longest(h: int, w: int, max_len: int) -> tuple[int, int]:
    """Longest edge to max_len, aspect kept, the other edge rounded up to even (transformers' rule)."""
    aspect = w / h
    if w >= h:
        w, h = max_len, int(max_len / aspect)
        h += h % 2
    else:
        h, w = max_len, int(max_len * aspect)
        w += w % 2
    return max(h, 1), max(w, 1)


def _cap(h: int, w: int, max_len: int = MAX_IMAGE_SIZE) -> tuple[int, int]:
    """Scale down so neither edge passes max_len (aspect kept)."""
    aspect = w / h
    if w >= h and w > max_len:
        w, h = max_len, int(max_len / aspect)
    elif h > w and h > max_len:
        h, w = max_len, int(max_len * aspect)
    return max(h, 1), max(w, 1)


def _to_tile_multiples(h: int, w: int, tile: int) -> tuple[int, int]:
    """Both edges up to multiples of the tile size, the longer first (transformers' resize_for_vision_encoder)."""
    aspect = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / aspect) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * aspect) / tile) * tile
    return h, w


class Idefics3Processor:
    """An image -> its tiles' pixel values and the placeholder text for one `<image>` in the prompt."""

    image_token = IMAGE_TOKEN  # what marks an image in the prompt text, and the token its embeddings replace

    def __init__(self, cfg: Idefics3Config) -> None:
        self.cfg = cfg
        self._mean = np.asarray(cfg.image_mean, dtype=np.float32)
        self._std = np.asarray(cfg.image_std, dtype=np.float32)

    def frames(self, image: Any) -> tuple[list[Any], int, int]:
        """PIL RGB image -> (tiles row-major then the global view, rows, cols); rows = cols = 0: one frame."""
        c = self.cfg
        image = self._resize(image, *_cap(*_fit_longest(image.height, image.width, c.longest_edge)))
        if not c.do_image_splitting:
            return [self._resize(image, c.tile, c.tile)], 0, 0
        image = self._resize(image, *_to_tile_multiples(image.height, image.width, c.tile))
        if image.height <= c.tile and image.width <= c.tile:
            return [image], 0, 0
        rows, cols = image.height // c.tile, image.width // c.tile
        tiles = [image.crop((x * c.tile, y * c.tile, (x + 1) * c.tile, (y + 1) * c.tile))
                 for y in range(rows) for x in range(cols)]
        return tiles + [self._resize(image, c.tile, c.tile)], rows, cols

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """`frames`' (rows, cols) for an image of this size, by the same size arithmetic and no pixel."""
        c = self.cfg
        h, w = _cap(*_fit_longest(height, width, c.longest_edge))
        if not c.do_image_splitting:
            return 0, 0
        h, w = _to_tile_multiples(h, w, c.tile)
        return (0, 0) if h <= c.tile and w <= c.tile else (h // c.tile, w // c.tile)

    def placeholder_for(self, width: int, height: int) -> str:
        return self.placeholder(*self.grid(width, height))

    def _resize(self, image: Any, h: int, w: int) -> Any:
        return image.resize((w, h), resample=self.cfg.resample)

    def pixels(self, frame: Any) -> np.ndarray:
        """One frame -> [3, H, W] float32, rescaled then normalised (float64 rescale, float32 normalise)."""
        x = (np.asarray(frame, dtype=np.uint8).astype(np.float64) * self.cfg.rescale_factor).astype(np.float32)
        x = (x - self._mean) / self._std  # [H, W, 3]
        return np.ascontiguousarray(x.transpose(2, 0, 1))

    def placeholder(self, rows: int, cols: int) -> str:
        """The text that replaces one `<image>`: a tagged run of image tokens per tile, then the global view's."""
        run = IMAGE_TOKEN * self.cfg.image_seq_len
        glob = f"{FAKE_TOKEN}{GLOBAL_TAG}{run}{FAKE_TOKEN}"
        if rows == 0 and cols == 0:
            return glob
        grid = "".join("".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return f"{grid}\n{glob}"

    def process(self, image: Any) -> ProcessedImage:
        """PIL RGB image -> pixel values [F, 3, tile, tile] and its placeholder text."""
        frames, rows, cols = self.frames(image)
        return ProcessedImage(np.stack([self.pixels(f) for f in frames]), self.placeholder(rows, cols))
