"""Acceptance counting: the numbers behind the lmserve:spec_decode_* metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Totals since start, and what the last step added (metrics read the increments)."""

    num_speculative_tokens: int
    num_drafts: int = 0  # verify runs (a request with drafts in a step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_draft: int, num_accepted: int) -> None:
        """One verify run: `num_draft` drafts of which the first `num_accepted` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
