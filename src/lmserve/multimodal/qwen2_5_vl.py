"""Qwen2-VL / Qwen2.5-VL preprocessing (transformers' Qwen2VLImageProcessor, PIL backend) and the image span.

An image keeps its aspect ratio: `smart_resize` rounds each side to a multiple of patch x merge (28) with the area
kept within [min_pixels, max_pixels]; the normalised image is cut into 14x14 patches in merge-block order, each
repeated over the temporal patch (2, an image being a one-frame video): pixel_values [grid_h * grid_w, 3*2*14*14],
grid (1, grid_h, grid_w). In the prompt, `<|vision_start|>` + grid_h*grid_w/4 `<|image_pad|>` + `<|vision_end|>`.
The text model rotates by M-RoPE: `Qwen25VLProcessor.rope_positions` gives every prompt token its (time, row,
column) position, which the engine carries on each image (MMInput.rope).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .image_io import ImageData
from .processor import ProcessedImage
from .transforms import BICUBIC, CLIP_MEAN, CLIP_STD, rescale_normalize, resize, to_chw

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """(height, width), each a multiple of `factor`, area within [min_pixels, max_pixels], aspect ratio near kept."""
    if max(height, width) / min(height, width) > 200:
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class Qwen2VLImageProcessor:
    """The fields of a Qwen2(.5)-VL preprocessor_config.json that change pixels."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = BICUBIC
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = CLIP_MEAN
    std: tuple[float, ...] | None = CLIP_STD

    @classmethod
    def from_hf(cls, d: dict) -> Qwen2VLImageProcessor:
        """From a preprocessor_config.json's dict (`min_pixels`/`max_pixels` win over `size`, as in transformers)."""
        size = d.get("size") or {}
        norm = d.get("do_normalize", True)
        return cls(min_pixels=d.get("min_pixels") or size.get("shortest_edge", cls.min_pixels),
                   max_pixels=d.get("max_pixels") or size.get("longest_edge", cls.max_pixels),
                   patch_size=d.get("patch_size", 14), temporal_patch_size=d.get("temporal_patch_size", 2),
                   merge_size=d.get("merge_size", 2), resample=d.get("resample", BICUBIC),
                   rescale_factor=d.get("rescale_factor", 1 / 255) if d.get("do_rescale", True) else None,
                   mean=tuple(d.get("image_mean", CLIP_MEAN)) if norm else None,
                   std=tuple(d.get("image_std", CLIP_STD)) if norm else None)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image of this size is resized to."""
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(grid_t, grid_h, grid_w) in patches for an image of this size, known before any pixel is touched."""
        h, w = self.resized_size(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def patchify(self, chw: np.ndarray) -> np.ndarray:
        """[3, H, W] float32 -> [grid_h * grid_w, 3 * temporal * patch * patch], patches in merge-block order."""
        c, h, w = chw.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = chw.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [bh, bw, m, m, c, p, p]
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # the one frame, t times
        return x.reshape(gh * gw, c * t * p * p)

    def preprocess(self, image: ImageData) -> dict[str, np.ndarray]:
        """{"pixel_values": float32 [patches, 1176], "image_grid_thw": int64 [1, 3]}."""
        return self.preprocess_pil(image.image)

    def preprocess_pil(self, image: Any) -> dict[str, np.ndarray]:
        """`preprocess` of a decoded PIL image."""
        x = to_chw(image)
        x = resize(x, *self.resized_size(x.shape[1], x.shape[2]), self.resample)
        x = rescale_normalize(x, self.rescale_factor, self.mean, self.std)
        _, h, w = x.shape
        return {"pixel_values": self.patchify(x),
                "image_grid_thw": np.array([[1, h // self.patch_size, w // self.patch_size]], dtype=np.int64)}

    def num_image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """`<|image_pad|>` tokens for one image: its patches after the 2x2 merge."""
        t, h, w = grid_thw
        return t * h * w // self.merge_size ** 2


def placeholder_text(n_tokens: int) -> str:
    """The text the chat template's one `<|image_pad|>` expands to (Qwen2VLProcessor's expansion): the vision
    start/end around it are already in the template's text."""
    return IMAGE_PAD * n_tokens


def placeholder_ids(image_pad_id: int, n_tokens: int, vision_start_id: int | None = None,
                    vision_end_id: int | None = None) -> list[int]:
    """The ids an image takes: `<|image_pad|>` x n_tokens, wrapped in start/end when their ids are given (the chat
    template already writes `<|vision_start|><|image_pad|><|vision_end|>`; the processor repeats only the pad)."""
    pads = [image_pad_id] * n_tokens
    return pads if vision_start_id is None else [vision_start_id, *pads, vision_end_id]


def mrope_positions(input_ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]],
                    merge_size: int = 2) -> tuple[np.ndarray, int]:
    """M-RoPE position ids for a prompt (transformers' Qwen2_5_VLModel.get_rope_index, images only).

    Text runs count up by one on all three axes. An image's tokens (its `<|image_pad|>` run, t*h*w/merge^2 of them,
    one grid per image in order) take (frame, row, column) of the merged grid, each offset by the position the image
    starts at; the text after it resumes at that start + max(h, w) / merge. Returns ([3, len(input_ids)] int64 and
    the delta: a token at index i >= len(input_ids) (generated) has position i + delta on every axis.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    out = np.empty((3, len(ids)), dtype=np.int64)
    pos, i, images = 0, 0, iter(grids)
    while i < len(ids):
        if ids[i] == image_token_id:
            t, h, w = next(images)
            lt, lh, lw = t, h // merge_size, w // merge_size
            axes = np.meshgrid(np.arange(lt), np.arange(lh), np.arange(lw), indexing="ij")
            out[:, i:i + lt * lh * lw] = np.stack([a.reshape(-1) for a in axes]) + pos
            i += lt * lh * lw
            pos += max(lh, lw)
        else:
            end = i + 1
            while end < len(ids) and ids[end] != image_token_id:
                end += 1
            out[:, i:end] = np.arange(end - i) + pos
            pos += end - i
            i = end
    delta = int(out.max()) + 1 - len(ids) if len(ids) else 0
    return out, delta


@dataclass(frozen=True)
class Qwen25VLProcessor:
    """Qwen2.5-VL for the engine (multimodal/processor.py): the chat template writes one `<|image_pad|>` per image
    between `<|vision_start|>` and `<|vision_end|>`; it expands to one pad per merged patch, which the embeddings
    replace. The image's grid rides on its meta (encode_images' `grid`) and gives its tokens' M-RoPE positions."""

    pixels_of: Qwen2VLImageProcessor
    image_token = IMAGE_PAD
    image_text = VISION_START + IMAGE_PAD + VISION_END  # what its chat template writes for an image part

    @classmethod
    def from_dir(cls, path: Path) -> Qwen25VLProcessor:
        file = Path(path) / "preprocessor_config.json"
        return cls(Qwen2VLImageProcessor.from_hf(json.loads(file.read_text()) if file.is_file() else {}))

    def process(self, image: Any) -> ProcessedImage:
        out = self.pixels_of.preprocess_pil(image)
        grid = tuple(int(g) for g in out["image_grid_thw"][0])
        return ProcessedImage(out["pixel_values"], placeholder_text(self.pixels_of.num_image_tokens(grid)),
                              {"grid": grid})

    def placeholder_for(self, width: int, height: int) -> str:
        return placeholder_text(self.pixels_of.num_image_tokens(self.pixels_of.grid(height, width)))

    def rope_positions(self, ids: list[int], embed_token_id: int,
                       metas: Sequence[Mapping[str, Any] | None]) -> np.ndarray:
        """[3, len(ids)] M-RoPE positions of an expanded prompt whose images (in order) have these metas."""
        grids = [tuple(m["grid"]) for m in metas]
        return mrope_positions(ids, embed_token_id, grids, self.pixels_of.merge_size)[0]
