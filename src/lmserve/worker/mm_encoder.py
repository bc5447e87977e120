"""Images in the forward: each image encoded once (the encoder cache, keyed by its digest), its embeddings placed
at the prompt positions its placeholder tokens hold.

The runner keeps each running request's images (MMInput: digest, pixels, positions) from the step that sent it.
A step whose tokens reach an image's positions gets `inputs_embeds`: the token embeddings with those rows replaced.
The image is always encoded whole and then sliced to the step's positions, so a prefill chunk that ends inside an
image computes exactly what one whole prefill would. The cache outlives requests: a later request with the same
image, and a preempted request when it runs again, reuse the embeddings while they fit the budget (least
recently used first out).
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
