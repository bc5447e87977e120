"""What the scheduler decides each step: plain, picklable data with no tensors (numpy at most).

The runner keeps a persistent row per request (worker/input_batch.py); a step's output tells it
which rows to create (`new_requests`), which to drop (`finished_ids`), and what each scheduled row
computes: some known tokens (a prefill chunk, or the one token sampled last step) followed by
optional draft tokens to verify.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lmserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: what its persistent sampling row is built from."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # normally empty
    params: SamplingParams
    stop_token_ids: frozenset[int]  # ids banned while fewer than min_tokens were generated
    seed: int | None  # the completion's own seed; the runner creates its generator


@dataclass
class ScheduledRequest:
    """One request's share of a step: which tokens run, at which positions, in which blocks."""

    request_id: str
    token_ids: list[int]  # known tokens fed this step, then spec_token_ids
    start_pos: int  # position of token_ids[0] == num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table
    sample: bool  # True when the known tokens reach the request's end: the step samples a next one
    spec_token_ids: list[int] = field(default_factory=list)  # drafts at the end of token_ids, to verify
    # prompt positions in this chunk whose logits score the next prompt token (prompt logprobs): [start, end)
    prompt_logprob_range: tuple[int, int] | None = None
    # structured outputs: first row of this request's mask in SchedulerOutput.grammar_bitmask (one row per
    # logits row it samples: 1 + drafts); None when unconstrained or not sampling this step
    grammar_row: int | None = None
    lora_slot: int = -1  # device slot of the request's LoRA adapter; -1: the base model

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (num_scheduled_tokens in vLLM's words), drafts included."""
        return len(self.token_ids)

    @property
    def num_known(self) -> int:
        """Tokens fed this step that are not drafts."""
        return len(self.token_ids) - len(self.spec_token_ids)


@dataclass
class KVTransfers:
    """One step's copies between the KV pool and the tier below it (cache/kv_tier.py), as (block id, prefix hash).

    The runner (worker/kv_transfer.py) does `saves` and then `loads` before the forward (a block evicted this
    step may be the one a load fills), and `persists` after it (the forward writes those blocks).
    """

    saves: list[tuple[int, bytes]] = field(default_factory=list)  # evicted cached blocks: their old KV to host memory
    loads: list[tuple[int, bytes]] = field(default_factory=list)  # fresh blocks to fill from the tier
    persists: list[tuple[int, bytes]] = field(default_factory=list)  # blocks this step fills: to disk


@dataclass
class SchedulerOutput:
    """The batch of one engine step and the changes to the set of requests since the last one."""

    requests: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # ended since the last step: drop their rows
    preempted_ids: list[str] = field(default_factory=list)  # blocks freed; rows kept for when they resume
    # allowed tokens of every constrained sampling row, [rows, ceil(V / 32)] int32 (bit t % 32 of word t // 32)
    grammar_bitmask: np.ndarray | None = None
    kv_transfers: KVTransfers | None = None  # with a KV tier: the copies this step needs (None: none)

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests
