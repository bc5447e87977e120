"""Acceptance counting (the numbers behind the lmserve:spec_decode_* metrics) and per-request back-off."""

from __future__ import annotations

from dataclasses import dataclass, field

# Below this smoothed acceptance rate a request stops drafting for a while: a rejected draft costs a
# verify row (on CPU ~5 ms per extra row of a 135M model), so drafts that rarely land only slow it down.
MIN_ACCEPTANCE = 0.3
MAX_PAUSE_STEPS = 64


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

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class Backoff:
    """One request's recent acceptance; pauses its drafting (for growing spans) while acceptance is low."""

    rate: float = 1.0  # exponentially smoothed accepted / drafted
    pause: int = 0  # steps left without drafts
    next_pause: int = 2

    def allows(self) -> bool:
        """True when the request may draft this step (counts down a pause)."""
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.rate = 0.5 * self.rate + 0.5 * (num_accepted / num_draft)
        if self.rate < MIN_ACCEPTANCE:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, MAX_PAUSE_STEPS)
            self.rate = MIN_ACCEPTANCE  # after the pause, one good run lifts it again
        elif num_accepted == num_draft:
            self.next_pause = 2
