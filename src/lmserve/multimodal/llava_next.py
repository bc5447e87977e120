"""LLaVA-NeXT's "anyres" preprocessing (transformers' LlavaNextImageProcessor, PIL backend) and its token count.

The image is fitted (aspect kept, bicubic) into the grid resolution that keeps the most of it with the least waste
(`image_grid_pinpoints`), centred on black padding and cut into crop-size tiles; a squashed whole-image view goes
first. The tower encodes every tile; the model unpads the tile features back to the image's aspect and ends each
row with an `image_newline` embedding, so the token count depends on the image size (`num_image_tokens`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .image_io import ImageData
from .llava import CLIPImageProcessor, _read_json
from .processor import ProcessedImage
from .transforms import BICUBIC, CLIP_MEAN, CLIP_STD, rescale_normalize, resize, to_chw

PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))  # llava-v1.6's (height, width) grids


def select_best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The (height, width) pinpoint that keeps the most pixels of the image, ties to the least padding."""
    best, best_kept, best_waste = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = w * h - kept
        if kept > best_kept or (kept == best_kept and waste < best_waste):
            best, best_kept, best_waste = (h, w), kept, waste
    return best


def fit_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """The image's size fitted inside target with its aspect ratio (the long fit side exact, the other rounded up)."""
    th, tw = target
    if tw / width < th / height:
        return min(math.ceil(height * tw / width), th), tw
    return th, min(math.ceil(width * th / height), tw)


def unpadded_size(height: int, width: int, grid_h: int, grid_w: int) -> tuple[int, int]:
    """The (rows, cols) of a grid_h x grid_w feature map left after cutting the padding an image of this size got
    (transformers' unpad_image arithmetic, rounded the same way)."""
    if width / height > grid_w / grid_h:
        pad = (grid_h - int(round(height * (grid_w / width), 7))) // 2
        return grid_h - 2 * pad, grid_w
    pad = (grid_w - int(round(width * (grid_h / height), 7))) // 2
    return grid_h, grid_w - 2 * pad


@dataclass(frozen=True)
class LlavaNextImageProcessor:
    """The fields of a LLaVA-NeXT preprocessor_config.json that change pixels."""

    tile: int = 336  # crop size: each tile's side and the base view's
    pinpoints: tuple[tuple[int, int], ...] = PINPOINTS
    resample: int = BICUBIC
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = CLIP_MEAN
    std: tuple[float, ...] | None = CLIP_STD

    @classmethod
    def from_hf(cls, d: dict) -> LlavaNextImageProcessor:
        """From a preprocessor_config.json's dict (square crops, as every LLaVA-NeXT checkpoint has)."""
        clip = CLIPImageProcessor.from_hf(d)
        return cls(tile=clip.crop[0], pinpoints=tuple(tuple(p) for p in d.get("image_grid_pinpoints", PINPOINTS)),
                   resample=clip.resample, rescale_factor=clip.rescale_factor, mean=clip.mean, std=clip.std)

    def tile_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles for an image of this size."""
        h, w = select_best_resolution(height, width, self.pinpoints)
        return h // self.tile, w // self.tile

    def tiles(self, chw: np.ndarray) -> list[np.ndarray]:
        """uint8 [3, H, W] -> the base view then the tiles row by row, each uint8 [3, tile, tile]."""
        _, h, w = chw.shape
        target = select_best_resolution(h, w, self.pinpoints)
        fh, fw = fit_size(h, w, target)
        fitted = resize(chw, fh, fw, self.resample)
        canvas = np.zeros((3, *target), dtype=np.uint8)  # black padding, centred (the odd pixel after)
        top, left = (target[0] - fh) // 2, (target[1] - fw) // 2
        canvas[:, top:top + fh, left:left + fw] = fitted
        t = self.tile
        grid = [canvas[:, i:i + t, j:j + t] for i in range(0, target[0], t) for j in range(0, target[1], t)]
        return [resize(chw, t, t, self.resample), *grid]

    def preprocess(self, image: ImageData) -> dict[str, np.ndarray]:
        """{"pixel_values": float32 [1, 1 + rows*cols, 3, tile, tile], "image_sizes": [[H, W]],
        "tile_grid": [[rows, cols]]}."""
        chw = to_chw(image.image)
        views = [rescale_normalize(v, self.rescale_factor, self.mean, self.std) for v in self.tiles(chw)]
        h, w = chw.shape[1:]
        return {"pixel_values": np.stack(views)[None], "image_sizes": np.array([[h, w]], dtype=np.int64),
                "tile_grid": np.array([self.tile_grid(h, w)], dtype=np.int64)}

    def num_image_tokens(self, height: int, width: int, patch_size: int, select: str = "default") -> int:
        """`<image>` placeholders for an image of this size: the base view's patches, then the unpadded tile features
        with one newline per row."""
        side = self.tile // patch_size
        rows, cols = self.tile_grid(height, width)
        uh, uw = unpadded_size(height, width, rows * side, cols * side)
        return side * side + (select != "default") + uh * (uw + 1)


def placeholder_text(n_tokens: int, image_token: str = "<image>") -> str:
    """The text one `<image>` expands to, n_tokens from LlavaNextImageProcessor.num_image_tokens."""
    return image_token * n_tokens


@dataclass(frozen=True)
class LlavaNextProcessor:
    """LLaVA-NeXT for the engine (multimodal/processor.py): an image -> its views [1 + rows*cols, 3, tile, tile],
    its size and tile grid as `meta` (the model's encode_images unpads by them), and one `image_token` per
    embedding."""

    pixels_of: LlavaNextImageProcessor
    patch_size: int
    select: str = "default"
    image_token: str = "<image>"

    @classmethod
    def from_dir(cls, path: Path) -> LlavaNextProcessor:
        """From a model directory: preprocessor_config.json (its pinpoints, else config.json's), config.json's
        patch size and selection, processor_config.json's image token."""
        cfg, pre = _read_json(path / "config.json"), _read_json(path / "preprocessor_config.json")
        if "image_grid_pinpoints" not in pre and "image_grid_pinpoints" in cfg:
            pre = pre | {"image_grid_pinpoints": cfg["image_grid_pinpoints"]}
        patch = int((cfg.get("vision_config") or {}).get("patch_size", 32))
        token = _read_json(path / "processor_config.json").get("image_token", "<image>")
        return cls(LlavaNextImageProcessor.from_hf(pre), patch, cfg.get("vision_feature_select_strategy", "default"),
                   token)

    def process(self, image: Any) -> ProcessedImage:
        out = self.pixels_of.preprocess(ImageData(image=image, digest=""))
        (h, w), grid = out["image_sizes"][0].tolist(), tuple(out["tile_grid"][0].tolist())
        return ProcessedImage(out["pixel_values"][0], self.placeholder_for(w, h),
                              {"image_size": (h, w), "tile_grid": grid})

    def placeholder_for(self, width: int, height: int) -> str:
        return placeholder_text(self.pixels_of.num_image_tokens(height, width, self.patch_size, self.select),
                                self.image_token)
