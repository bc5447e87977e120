"""A prompt's images -> the engine's view of them: each image's marker token expanded into its placeholder tokens,
and one MMInput per image (pixels, digest, the positions its embeddings fill). Runs in the front end
(engine/front.py), on the caller's thread: decoding and resizing never block the engine thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from typing import Sequence

import numpy as np

from lmserve.errors import RequestRejected
from lmserve.multimodal.image_io import ImageData
from lmserve.multimodal.processor import MMInput, VisionProcessor
from lmserve.tokenizer import Tokenizer

PLACEHOLDER_SIZES = 1024  # image sizes whose placeholder length is remembered


class PromptImages:
    """One vision model's processor and the token ids its placeholders are made of."""

    def __init__(self, processor: VisionProcessor, tokenizer: Tokenizer) -> None:
        self.processor, self.tokenizer = processor, tokenizer
        marker = tokenizer.encode_prompt(processor.image_token, add_special_tokens=False)
        if len(marker) != 1:
            raise ValueError(f"the tokenizer has no single token for {processor.image_token!r}")
        self.image_token_id = marker[0]
        # the token the embeddings replace, where it is not the marker (Gemma 3: `<start_of_image>` expands to text
        # holding `<image_soft_token>`s)
        embed = getattr(processor, "embed_token", None) or processor.image_token
        soft = tokenizer.encode_prompt(embed, add_special_tokens=False)
        if len(soft) != 1:
            raise ValueError(f"the tokenizer has no single token for {embed!r}")
        self.embed_token_id = soft[0]
        self._lengths: dict[tuple[int, int], int] = {}  # (width, height) -> placeholder tokens (_placeholder_len)
        self._lengths_lock = threading.Lock()

    def count(self, ids: list[int], sizes: Sequence[tuple[int, int]]) -> int:
        """The length `expand` gives `ids` with images of these (width, height)s, from the sizes alone (each
        placeholder tokenized, no pixel touched): a request too long for the context is refused before decoding."""
        self._check_marks(ids, len(sizes))
        return len(ids) - len(sizes) + sum(self._placeholder_len(w, h) for w, h in sizes)

    def _placeholder_len(self, width: int, height: int) -> int:
        """Tokens of the placeholder for an image of this size, remembered per size (LRU): a client repeating
        images past the context costs a dict lookup per image, not a tokenization of its thousands of tokens."""
        key = (width, height)
        with self._lengths_lock:  # admission threads share it
            n = self._lengths.pop(key, None)
        if n is None:
            n = len(self.tokenizer.encode_prompt(_placeholder(self.processor, width, height), add_special_tokens=False))
        with self._lengths_lock:
            self._lengths[key] = n  # the most recent last
            if len(self._lengths) > PLACEHOLDER_SIZES:
                del self._lengths[next(iter(self._lengths))]
        return n

    def _check_marks(self, ids: list[int], n_images: int) -> list[int]:
        marks = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(marks) != n_images:
            raise RequestRejected(f"the prompt has {len(marks)} image placeholder(s) "
                                  f"({self.processor.image_token}) for {n_images} image(s)", "messages")
        return marks

    def expand(self, ids: list[int], images: Sequence[object]) -> tuple[list[int], tuple[MMInput, ...]]:
        """`ids` with its k-th marker token replaced by image k's placeholder ids; one MMInput per image."""
        images = [_as_image_data(im) for im in images]
        marks = self._check_marks(ids, len(images))
        out: list[int] = []
        inputs, metas = [], []
        prev = 0
        for mark, img in zip(marks, images):
            out += ids[prev:mark]
            try:
                processed = self.processor.process(img.image)
            except ValueError as e:  # a size the family's resize refuses (Qwen2.5-VL: aspect ratio past 200)
                raise RequestRejected(f"the image cannot be prepared for this model: {e}", "messages") from None
            metas.append(processed.meta)
            span = self.tokenizer.encode_prompt(processed.placeholder, add_special_tokens=False)
            where = np.flatnonzero(np.asarray(span) == self.embed_token_id) + len(out)
            inputs.append(MMInput(img.digest, processed.pixel_values, where.astype(np.int64),
                                  processed.meta, getattr(self.processor, "bidirectional", False)))
            out += span
            prev = mark + 1
        out += ids[prev:]
        return out, self._with_rope(out, inputs, metas)


    def _with_rope(self, ids: list[int], inputs: list[MMInput], metas: list) -> tuple[MMInput, ...]:
        """The images, each with its tokens' M-RoPE positions where the family rotates so (MMInput.rope)."""
        rope_positions = getattr(self.processor, "rope_positions", None)
        if rope_positions is None or not inputs:
            return tuple(inputs)
        pos = rope_positions(ids, self.embed_token_id, metas)  # [3, len(ids)]
        return tuple(dataclasses.replace(mm, rope=np.ascontiguousarray(pos[:, mm.positions])) for mm in inputs)


def _placeholder(processor: VisionProcessor, width: int, height: int) -> str:
    try:
        return processor.placeholder_for(width, height)
    except ValueError as e:  # as in `expand`
        raise RequestRejected(f"the image cannot be prepared for this model: {e}", "messages") from None


def _as_image_data(image: object) -> ImageData:
    """ImageData as it comes; a PIL image (the offline API) named by the hash of its pixels."""
    if isinstance(image, ImageData):
        return image
    if hasattr(image, "convert") and hasattr(image, "tobytes"):
        rgb = image.convert("RGB")
        digest = hashlib.sha256(b"%dx%d:" % rgb.size + rgb.tobytes()).hexdigest()
        return ImageData(image=rgb, digest=digest)
    raise RequestRejected(f"an image must be a decoded image (PIL or ImageData), got {type(image).__name__}")


def image_salt(inputs: Sequence[MMInput]) -> bytes:
    """What the prompt's prefix-cache blocks are salted with beside the caller's salt: the images' digests, in
    order, so the same text with another image never shares a block and the same image does."""
    return b"img:" + b",".join(m.digest.encode() for m in inputs) if inputs else b""
