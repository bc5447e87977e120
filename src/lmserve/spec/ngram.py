"""Prompt-lookup (n-gram) drafts: continue the sequence the way it continued after the same n tokens
earlier in its own context. Free to compute, and right most of the time on input-grounded work
(copying, editing, quoting, code fixes), where output tokens repeat runs of the prompt.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix.

    tokens [L] int64 (prompt + output). Suffix lengths are tried from n_max down to n_min; the first
    length with a match wins. Returns [] when nothing matches.
    """
    L = tokens.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[:L - 1], n)  # window i = tokens[i:i+n], never the suffix itself
        hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Drafts by prompt lookup over each request's own tokens (no model, no state)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, reqs: list, limits: list[int]) -> list[list[int]]:
        """Drafts for each request (a `Request`), at most limits[i] tokens each."""
        return [propose_ngram(np.asarray(r.all_token_ids, dtype=np.int64), self.n_min, self.n_max, k) if k else []
                for r, k in zip(reqs, limits)]

    def remove(self, request_id: str) -> None:
        """Nothing is kept per request."""
