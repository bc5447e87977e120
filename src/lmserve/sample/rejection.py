"""Speculative-decoding verification (Leviathan et al. 2023; Chen et al. 2023), vectorised over rows.

A row verifies the draft token d proposed at its position, drawn from the drafter's distribution q,
against the target distribution p of that position. The draft is accepted with probability
min(1, p(d) / q(d)); at the first rejection the token is drawn from norm(max(p - q, 0)) instead. The
tokens kept then follow p exactly, whatever q was. A deterministic drafter (n-gram lookup, a greedy
draft model) has a one-hot q, so acceptance is p(d) and the residual is p without d. Greedy rows
accept d when it equals the argmax and keep the argmax: output identical to decoding without drafts.
"""

from __future__ import annotations

import torch


def accept_drafts(probs: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                  uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which drafts survive, and the distribution to draw each row's own token from.

    probs [B, V] target (need not be normalised per row: only ratios within a row matter, so rows are
    normalised here); draft_ids [B] (-1: no draft, the row samples from p); draft_probs [B, V] or None
    (one-hot drafts); uniform [B] in [0, 1). Returns (accepted [B] bool, residual [B, V]).
    """
    probs = probs / probs.sum(dim=-1, keepdim=True)
    has = draft_ids >= 0  # [B]
    d = draft_ids.clamp_min(0)[:, None]  # [B, 1]
    p_d = probs.gather(1, d).squeeze(1)  # [B]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        residual = probs.scatter(1, d, 0.0)
    else:
        q_d = draft_probs.gather(1, d).squeeze(1)
        residual = (probs - draft_probs).clamp_min_(0.0)
    accepted = has & (uniform * q_d <= p_d)
    # p == q leaves nothing: that row's draft is always accepted, but keep p so a draw stays defined
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(has[:, None] & ~empty, residual, probs)
    return accepted, residual
