"""A step's per-token adapter slots -> segments of rows per slot (pure numpy, built once per step)."""

from __future__ import annotations

import numpy as np

from lmserve.lora.layers import LoraMeta


def token_slots(req_slots: list[int], req_lens: list[int]) -> np.ndarray:
    """[T] int64: each flat token row's adapter slot (-1: base), from its request's slot and token count."""
    return np.repeat(np.asarray(req_slots, dtype=np.int64), np.asarray(req_lens, dtype=np.int64))


def lora_segments(slots: np.ndarray, slot_ranks: list[int]) -> LoraMeta | None:
    """Group the rows of each used slot; None when no row uses an adapter (has_lora is false this step).

    Segments are padded to the longest one (padding repeats the segment's first row, masked to a zero
    delta), so the wrappers run one bmm over all segments: with 32 rows over 8 adapters that is [8, 4, in].
    """
    used = np.unique(slots[slots >= 0])
    if used.size == 0:
        return None
    groups = [np.flatnonzero(slots == s) for s in used]
    width = max(len(g) for g in groups)
    rows = np.empty((len(groups), width), dtype=np.int64)
    mask = np.zeros((len(groups), width, 1), dtype=np.float32)
    for i, g in enumerate(groups):
        rows[i, :len(g)], rows[i, len(g):] = g, g[0]
        mask[i, :len(g)] = 1.0
    rank = max(slot_ranks[s] for s in used)
    return LoraMeta(used.astype(np.int64), rows, mask, max(rank, 1))
