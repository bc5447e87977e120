"""What a vision family's preprocessing gives the engine (multimodal/registry.py finds an architecture's).

A processor (one per family: multimodal/idefics3.py) turns one decoded image into its pixel values and the text
that replaces the image's marker (`image_token`) in the prompt. The engine front end (engine/front.py) tokenizes
that text and records where the image's embeddings go (`MMInput`); the runner encodes the pixels once per image
digest and scatters the embeddings there (worker/mm_encoder.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Protocol

import numpy as np


class ProcessedImage(NamedTuple):
    """One image, ready for its vision tower: pixel values and the prompt text that stands in for it."""

    pixel_values: np.ndarray  # float32, the family's layout (Idefics3: [frames, 3, tile, tile])
    placeholder: str  # replaces one `image_token` in the prompt text; holds one `image_token` per embedding
    # what else the model's encode_images takes for this image, by keyword (LLaVA-NeXT: its size and tile grid)
    meta: Mapping[str, Any] | None = None


class VisionProcessor(Protocol):
    """A family's preprocessing: `image_token` marks an image in the prompt; `process` prepares one image.

    An M-RoPE family also has `rope_positions(ids, embed_token_id, metas) -> [3, len(ids)]`: the expanded prompt's
    positions, given its images' metas in order (multimodal/qwen2_5_vl.py)."""

    image_token: str

    def process(self, image: Any) -> ProcessedImage: ...

    def placeholder_for(self, width: int, height: int) -> str:
        """`process(image).placeholder` for an image of this size, from the size alone: the server counts a
        request's prompt tokens from its images' headers before decoding any (tests/test_vision_preprocess.py
        checks it equals `process`'s for every family)."""
        ...


@dataclass(frozen=True)
class MMInput:
    """One image of one request as the runner needs it: what to encode, and the prompt positions its embeddings
    fill (ascending; as many as the embeddings the model's encode_images returns for these pixels)."""

    digest: str  # sha256 of the image's bytes: the encoder cache's key
    pixel_values: np.ndarray
    positions: np.ndarray  # int64 [num_embeddings]: prompt indices of this image's placeholder tokens
    meta: Mapping[str, Any] | None = None  # ProcessedImage.meta: encode_images' keyword arguments beside the pixels
    # its tokens attend to each other both ways (Gemma 3): the scheduler never ends a prefill chunk inside its span
    # and the runner gives the span to attention
    bidirectional: bool = False
    # M-RoPE models (Qwen2.5-VL): int64 [3, num_embeddings], the (time, row, column) position of each of its tokens
    # (the processor's `rope_positions`). Text after it resumes at rope.max() + 1, counting up on all three axes: the
    # runner derives every token's position from its images alone (worker/mm_encoder.py `rope_positions`)
    rope: np.ndarray | None = None

    @property
    def span(self) -> tuple[int, int]:
        """[first, last + 1) of the positions: a chunk that misses this range needs no embedding of it."""
        return int(self.positions[0]), int(self.positions[-1]) + 1


def image_text(processor: VisionProcessor) -> str:
    """The text one image stands for in a prompt written without a chat template's image parts (`lmserve generate
    --image`, `lmserve chat`'s /image): the processor's `image_text` where the model's template wraps the marker
    (Qwen2.5-VL: vision start, pad, vision end), else the marker itself."""
    return getattr(processor, "image_text", processor.image_token)
