"""Sampling filters on temperature-scaled logits: top-k, top-p (nucleus) and min-p, vectorised over rows.

Top-k keeps every token whose logit ties the k-th largest (as vLLM does), so the sort-based path and
the top-k-only fast path agree exactly.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def top_k_top_p(x: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Reference path: one descending sort, mask the top-k tail, then the top-p tail, scatter back.

    x [F, V]; k [F] int64 in [1, V] (V = off); p [F] float32 in (0, 1] (1 = off). Returns a new tensor.
    """
    sorted_x, order = x.sort(dim=-1, descending=True)  # [F, V]
    if k is not None:
        kth = sorted_x.gather(1, (k - 1)[:, None])  # [F, 1]
        sorted_x = sorted_x.masked_fill(sorted_x < kth, NEG_INF)
    if p is not None:
        probs = sorted_x.softmax(dim=-1)  # renormalised over what top-k kept
        mass_before = probs.cumsum(dim=-1) - probs  # mass ranked strictly above; 0 for the top token
        # Keep the smallest prefix holding mass p. Rows with p = 1 are exempt: float rounding can push
        # the cumulative sum past 1 and would otherwise cut their tail.
        drop = (mass_before >= p[:, None]) & (p[:, None] < 1.0)
        sorted_x = sorted_x.masked_fill(drop, NEG_INF)
    return x.scatter(-1, order, sorted_x)


def top_k_only(x: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Fast path when no row uses top-p: a top-max_k selection instead of a full sort.

    x [F, V]; k [F] int64 in [1, max_k]. Returns a new tensor, equal to top_k_top_p(x, k, None).
    """
    top = x.topk(max_k, dim=-1).values  # [F, max_k], descending
    kth = top.gather(1, (k - 1)[:, None])  # [F, 1]
    return x.masked_fill(x < kth, NEG_INF)


def min_p_filter(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens with probability below min_p times the row's top probability.

    probs [B, V] (need not be normalised: the threshold is relative); min_p [B] (0 = off).
    """
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return probs.masked_fill(probs < threshold, 0.0)
