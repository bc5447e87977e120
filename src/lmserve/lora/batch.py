"""A step's per-token adapter slots -> segments of rows per slot (pure numpy, built once per step)."""

from __future__ import annotations

import numpy as np

from lmserve.lora.layers import LoraMeta


def token_slots(req_slots: list[int], req_lens: list[int]) -> np.ndarray:
    """[T] int64: each flat token row's adapter slot (-1: base), from its request's slot and token count."""
    return np.repeat(np.asarray(req_slots, dtype=np.int64), np.asarray(req_lens, dtype=np.int64))


# Padding to the longest segment pays while it at most doubles the rows: a decode batch over several adapters
# pads little and runs as three bmm's; a long prefill chunk beside one-row decodes would multiply its
# adapter work by the number of slots, so such steps run one slot at a time instead.
MAX_PADDING = 2.0


def lora_segments(slots: np.ndarray, slot_ranks: list[int], max_padding: float = MAX_PADDING) -> LoraMeta | None:
    """Group the rows of each slot 0..highest used; None when no row uses an adapter (has_lora is false).

    Segments are padded to the longest one, so the wrappers run one bmm over all of them: with 32 rows
    over 8 adapters that is [8, 4, in]. Padding (and an unused slot's whole segment) points at a row that
    carries an adapter, with mask 0: it adds an exact +0.0 there, and nothing ever reaches a base row.
    """
    lora_rows = np.flatnonzero(slots >= 0)
    if lora_rows.size == 0:
        return None
    num_segs = int(slots.max()) + 1
    groups = [np.flatnonzero(slots == s) for s in range(num_segs)]
    width = max(len(g) for g in groups)
    rows = np.full((num_segs, width), lora_rows[0], dtype=np.int64)
    mask = np.zeros((num_segs, width, 1), dtype=np.float32)
    for i, g in enumerate(groups):
        rows[i, :len(g)] = g
        mask[i, :len(g)] = 1.0
    used = np.unique(slots[lora_rows])
    rank = max(max(slot_ranks[s] for s in used), 1)
    if rows.size > max_padding * lora_rows.size:
        return LoraMeta(None, None, None, rank, False, [(int(s), groups[s]) for s in used],
                        slots.astype(np.int64))
    return LoraMeta(rows, mask, rows.reshape(-1), rank, bool((mask == 0).any()), slots=slots.astype(np.int64))
