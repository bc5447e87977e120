"""Images in the forward: each image encoded once (the encoder cache, keyed by its digest), its embeddings placed
at the prompt positions its placeholder tokens hold.

The runner keeps each running request's images (MMInput: digest, pixels, positions) from the step that sent it.
A step whose tokens reach an image's positions gets `inputs_embeds`: the token embeddings with those rows replaced.
The image is always encoded whole and then sliced to the step's positions, so a prefill chunk that ends inside an
image computes exactly what one whole prefill would. The cache outlives requests: a later request with the same
image, and a preempted request when it runs again, reuse the embeddings while they fit the budget (least
recently used first out).

M-RoPE models (Qwen2.5-VL) rotate by (time, row, column) positions: `rope_positions` gives a step's tokens theirs,
from the images each request carries (MMInput.rope), for prefill chunks, decodes and drafts alike.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import numpy as np
import torch

from lmserve.multimodal.processor import MMInput
from lmserve.sched.output import ScheduledRequest

ENCODER_CACHE_TOKENS = 16384  # embeddings kept (rows of hidden_size): SmolVLM's 13-frame photo is 832


class EncoderCache:
    """digest -> an image's embeddings [n, hidden] on the device, least recently used evicted past the budget."""

    def __init__(self, encode: Any, device: torch.device, budget_tokens: int = ENCODER_CACHE_TOKENS) -> None:
        self.encode, self.device, self.budget = encode, device, budget_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._tokens = 0
        self.num_encoded = 0  # images run through the encoder (a cache hit runs none)

    def get(self, mm: MMInput) -> torch.Tensor:
        hit = self._entries.get(mm.digest)
        if hit is not None:
            self._entries.move_to_end(mm.digest)
            return hit
        emb = self.encode(torch.from_numpy(mm.pixel_values).to(self.device), **(mm.meta or {}))
        self.num_encoded += 1
        if emb.shape[0] != len(mm.positions):
            raise ValueError(f"the image encodes to {emb.shape[0]} embeddings for {len(mm.positions)} placeholders")
        self._entries[mm.digest] = emb
        self._tokens += emb.shape[0]
        while self._tokens > self.budget and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._tokens -= old.shape[0]
        return emb

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries


class ImageInputs:
    """The running requests' images, and each step's inputs_embeds where its tokens reach them."""

    def __init__(self, model: torch.nn.Module, device: torch.device,
                 budget_tokens: int = ENCODER_CACHE_TOKENS) -> None:
        self.model = model
        self.cache = EncoderCache(model.encode_images, device, budget_tokens)
        self._images: dict[str, tuple[MMInput, ...]] = {}

    def add(self, request_id: str, images: tuple[MMInput, ...]) -> None:
        if images:
            self._images[request_id] = images

    def drop(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._images.pop(rid, None)

    def bidirectional_spans(self) -> dict[str, list[tuple[int, int]]]:
        """request id -> the [a, b) spans of its images whose tokens attend both ways (Gemma 3); {} for others."""
        out: dict[str, list[tuple[int, int]]] = {}
        for rid, images in self._images.items():
            spans = [mm.span for mm in images if mm.bidirectional]
            if spans:
                out[rid] = spans
        return out

    def rope_positions(self, requests: list[ScheduledRequest], order: list[int], positions: np.ndarray) -> np.ndarray:
        """The step's rotary positions: `positions` [T] (flat order) where every token's three M-RoPE axes agree,
        else [3, T]. A token at prompt index p of a request with images is at its image's `rope` inside one, else
        at p shifted by the images before it: rope.max() + 1 of the last one ending at or before p, plus p's
        distance from that end (transformers' rope_deltas, for every text and generated token after it)."""
        with_rope = {rid for rid, images in self._images.items() if images[0].rope is not None}
        if not with_rope:
            return positions
        out = np.broadcast_to(positions, (3, len(positions))).copy()  # [3, T]
        offset = 0
        for i in order:
            s = requests[i]
            if s.request_id in with_rope:
                rows = slice(offset, offset + s.num_tokens)
                out[:, rows] = _mrope_of(self._images[s.request_id], positions[rows])
            offset += s.num_tokens
        return out[0].copy() if (out[0] == out[1]).all() and (out[0] == out[2]).all() else out

    def placements(self, requests: list[ScheduledRequest], order: list[int]) -> list[tuple[np.ndarray, torch.Tensor]]:
        """(flat rows, embeddings) of each image part this step's known tokens cover, `order` the flat order."""
        out, offset = [], 0
        for i in order:
            s = requests[i]
            lo, hi = s.start_pos, s.start_pos + s.num_known
            for mm in self._images.get(s.request_id, ()):
                a, b = mm.span
                if a < hi and b > lo:
                    sel = (mm.positions >= lo) & (mm.positions < hi)
                    emb = self.cache.get(mm)
                    out.append((offset + mm.positions[sel] - lo, emb[torch.from_numpy(np.flatnonzero(sel)).to(emb.device)]))
            offset += s.num_tokens
        return out

    def inputs_embeds(self, input_ids: torch.Tensor, placed: list[tuple[np.ndarray, torch.Tensor]]) -> torch.Tensor:
        """The step's token embeddings [T, hidden] with the placed images' rows written over theirs."""
        x = self.model.embed(input_ids)
        rows = torch.from_numpy(np.concatenate([r for r, _ in placed])).to(x.device)
        x[rows] = torch.cat([e for _, e in placed]).to(x.dtype)
        return x


def _mrope_of(images: tuple[MMInput, ...], p: np.ndarray) -> np.ndarray:
    """[3, len(p)] M-RoPE positions of one request's tokens at prompt indices `p`, from its images (ascending)."""
    out = np.broadcast_to(p, (3, len(p))).copy()
    for mm in images:
        a, b = mm.span
        after = p >= b
        out[:, after] = int(mm.rope.max()) + 1 + (p[after] - b)  # the later images overwrite theirs
        inside = (p >= a) & (p < b)
        out[:, inside] = mm.rope[:, np.searchsorted(mm.positions, p[inside])]
    return out
