"""Apply grammar bitmasks to logits: the one op the sampler runs for constrained rows (torch only)."""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is 0. logits [B, V] float32, bitmask [G, W] int32."""
    vocab = logits.shape[1]
    shifts = _SHIFTS.to(bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()  # [G, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[G, V] bool, one token at a time: the plain reading of the bitmask layout (tests compare with it)."""
    out = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool)
    words = bitmask.tolist()
    for g, row in enumerate(words):
        for t in range(vocab):
            out[g, t] = (row[t // 32] >> (t % 32)) & 1 == 1
    return out
