"""How one step's token budget is shared between the requests that want tokens (vLLM's budget, made fair).

Between tenants (API key names) the split is max-min fair by tokens ("water-filling"): a tenant that wants less
than an equal share gets all it wants, and the others share the rest equally. Within a tenant its share goes to
its smallest demands first: a decode, a short prompt or a prompt's last chunk never waits behind a long prefill,
which takes what is left, in chunks (long prefills among themselves keep schedule order: FCFS, as vLLM's one
partial prefill at a time). So a 1-token request that arrives while another key's 3,000-token prompt prefills runs
in the next step, and no key takes another's share by sending more requests, more beams or a larger embedding
batch: those are requests like any other, each counted by the tokens it computes.

With chunked prefill off a prompt runs whole or not at all, so demands are met in schedule order instead (the
old rule): a fair split would cut every prompt short and admit none.

The budget itself (`StepBudget`) is --max-num-batched-tokens, or, unless that flag is given, what this host
prefills in `SchedulerConfig.step_seconds` (measured at warm-up, engine/step_budget.py, and refitted as steps
run): a short request then waits for about one such step to end, and a slow host gives shorter steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmserve.config import SchedulerConfig

# A fitted budget never goes below this: tiny steps would spend more time on per-step overhead than on tokens.
MIN_STEP_TOKENS = 32


@dataclass(frozen=True)
class Demand:
    """Tokens one request could compute this step (known tokens plus drafts), and whose share they come from."""

    request_id: str
    tenant: str
    tokens: int


def split_budget(budget: int, demands: Sequence[Demand], chunked: bool = True) -> dict[str, int]:
    """request id -> tokens it may compute this step; demands in schedule order (running, then waiting)."""
    if not chunked:
        return _in_order(budget, demands)
    tenants: dict[str, list[Demand]] = {}
    for d in demands:
        tenants.setdefault(d.tenant, []).append(d)
    shares = water_fill(budget, [sum(d.tokens for d in ds) for ds in tenants.values()])
    grants: dict[str, int] = {}
    for share, ds in zip(shares, tenants.values()):
        grants.update(_in_order(share, sorted(ds, key=lambda d: d.tokens)))  # sorted() is stable: FCFS among equals
    return grants


def water_fill(budget: int, demands: Sequence[int]) -> list[int]:
    """Max-min fair split: demands below the equal share of what is left are met in full, the rest share equally.

    Integer tokens: the largest demands come last and take the remainders, so the whole budget is handed out
    whenever the demands add up to at least that much.
    """
    grants = [0] * len(demands)
    left = budget
    order = sorted(range(len(demands)), key=lambda i: demands[i])
    for k, i in enumerate(order):
        grants[i] = min(demands[i], left // (len(order) - k))
        left -= grants[i]
    return grants


class StepBudget:
    """The tokens of every step: max_num_batched_tokens, or (with `step_seconds`) what this host prefills in that
    long, fitted at warm-up (engine/step_budget.py) and refitted from every step whose prompt tokens fill at least
    half of it (load and the context a chunk attends to change what a token costs), as the mean of the last rate
    and the step's own."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.tokens = cfg.max_num_batched_tokens
        # with chunked prefill off a whole prompt of up to max_num_batched_tokens must fit in one step
        self.fitted = cfg.step_seconds is not None and cfg.enable_chunked_prefill
        self.rate: float | None = None  # prompt tokens per second, as last measured

    def fit(self, rate: float) -> None:
        """Set the budget from a measured prefill rate (prompt tokens per second)."""
        if self.fitted:
            self.rate = rate
            self.tokens = fitted_budget(self.cfg.max_num_batched_tokens, rate, self.cfg.step_seconds,
                                        self.cfg.max_num_seqs)

    def observe(self, seconds: float, num_prefill_tokens: int) -> None:
        """A step ran: refit from it if its prompt tokens were most of it (in smaller ones fixed costs dominate)."""
        if self.rate is not None and num_prefill_tokens >= self.tokens // 2 and seconds > 0:
            self.fit((self.rate + num_prefill_tokens / seconds) / 2)


def fitted_budget(max_tokens: int, tokens_per_s: float, seconds: float, max_num_seqs: int) -> int:
    """The step budget on a host that prefills `tokens_per_s`: what it computes in `seconds`, within
    [max(MIN_STEP_TOKENS, max_num_seqs), max_tokens] (every running request can always advance by one token)."""
    floor = min(max_tokens, max(MIN_STEP_TOKENS, max_num_seqs))
    return max(floor, min(max_tokens, int(tokens_per_s * seconds)))


def _in_order(budget: int, demands: Sequence[Demand]) -> dict[str, int]:
    grants = {}
    for d in demands:
        grants[d.request_id] = min(d.tokens, budget)
        budget -= grants[d.request_id]
    return grants
