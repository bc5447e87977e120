"""What the scheduler decides each step: plain, picklable data with no tensors (numpy at most).

The runner keeps a persistent row per request (worker/input_batch.py: sampling state, token ids and block
table); a step's output tells it which rows to create (`new_requests`, sent whole once), which to drop
(`finished_ids`), and for each scheduled request what it computes (some known tokens, a prefill chunk or the
one token sampled last step, then optional draft tokens to verify) and only what its row lacks: the token
ids and block ids appended since the runner last saw it (vLLM v1's cached-request diffs). So a decode step
of a long request costs a few ints, not its whole history, also when it is pickled to every
tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from lmserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: its persistent row (tokens and sampling state) is built from this."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # normally empty; the row holds prompt + output tokens
    params: SamplingParams
    stop_token_ids: frozenset[int]  # ids banned while fewer than min_tokens were generated
    seed: int | None  # the completion's own seed; the runner creates its generator
    mm_inputs: tuple = ()  # the prompt's images (multimodal.processor.MMInput): the runner encodes and places them


@dataclass
class ScheduledRequest:
    """One request's share of a step: which tokens run at which positions, and what its row lacks.

    The runner first writes `new_token_ids` into the row's tokens at `token_start` and `new_block_ids` into its
    block table at `block_start` (each cut there first: a resumed request's table starts over at 0, blocks that
    only rejected drafts used are gone), then computes the known tokens at positions
    [start_pos, start_pos + num_known) and the drafts after them.
    """

    request_id: str
    start_pos: int  # position of the first token computed == num_computed_tokens before this step
    num_known: int  # tokens fed this step that are not drafts (num_scheduled_tokens without the drafts)
    sample: bool  # True when the known tokens reach the request's end: the step samples a next one
    new_token_ids: list[int] = field(default_factory=list)  # the request's tokens the runner's row lacks
    token_start: int = 0  # where new_token_ids go in the row
    # block ids the row's tables lack: as many for each KV group (cache/kv_groups.py), group after group
    new_block_ids: list[int] = field(default_factory=list)
    block_start: int = 0  # where new_block_ids go in the table (its length afterwards: + len(new_block_ids))
    spec_token_ids: list[int] = field(default_factory=list)  # drafts after the known tokens, to verify
    # prompt positions in this chunk whose logits score the next prompt token (prompt logprobs): [start, end)
    prompt_logprob_range: tuple[int, int] | None = None
    # structured outputs: first row of this request's mask in SchedulerOutput.grammar_bitmask (one row per
    # logits row it samples: 1 + drafts); None when unconstrained or not sampling this step
    grammar_row: int | None = None
    # a reasoning budget (structured/reasoning_budget.py): which of this request's logits rows (0 .. drafts) mask
    # its stop tokens, as min_tokens does (the worker's ban, not a bitmask row: nothing per step but the ids)
    stop_ban_rows: list[int] = field(default_factory=list)
    lora_slot: int = -1  # device slot of the request's LoRA adapter; -1: the base model
    pool: bool = False  # a pooling request: its rows' hidden states are pooled, never sampled (`sample`: pool now)

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (num_scheduled_tokens in vLLM's words), drafts included."""
        return self.num_known + len(self.spec_token_ids)

    def __reduce__(self) -> tuple:
        """Pickled (to every tensor-parallel rank, every step) as its values alone, without the field names."""
        return ScheduledRequest, tuple(getattr(self, f.name) for f in fields(self))


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
    def is_empty(self) -> bool:
        return not self.requests
