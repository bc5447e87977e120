"""What the scheduler decides each step: plain, picklable data with no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledRequest:
    """One request's share of a step: which new tokens run, at which positions, in which blocks."""

    request_id: str
    token_ids: list[int]  # the tokens fed this step (a prefill chunk, or the one last sampled token)
    start_pos: int  # position of token_ids[0] == num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table
    sample: bool  # True when this chunk reaches the last known token: the step samples a next one

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """The batch of one engine step."""

    requests: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests
