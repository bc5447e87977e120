"""The step budget fitted to this host: how many tokens one engine step carries, measured at warm-up and kept up
to date from the prefill steps the engine runs.

A step's length is its tokens times the host's time per token, and a loaded 2-core host prefilled a 3,100-token
step for over 300 s. Short requests wait for the step in progress to end, and the hung-step watchdog looks for
progress inside a step (worker/progress.py), so a step should carry what this host prefills in about
`SchedulerConfig.step_seconds`. Warm-up times one 32-token prefill and lowers the scheduler's budget to that. It
used to time a 256-token one after it wherever the first took under 0.1 s, i.e. in every quiet start: ~0.75 CPU s on
a 2-core Zen 3 (benchmarks/results/startup_zen3.md) before /health said 200, for a shape the first request does not
run. The short probe's rate is the lower one (a step's fixed costs weigh more in it), so the budget starts on the
safe side and the first long prompts raise it. What a token costs then moves with the host's load and with the
context a chunk attends to (on a loaded 2-core host a 1,024-token chunk took 5.4 s at position 0 and 17 s at
position 2,048), so every step whose prompt tokens fill at least half the budget refits it (sched/budget.StepBudget).

--max-num-batched-tokens, when given, is kept as it is (engine_config leaves step_seconds None then), and so
is the budget with chunked prefill off (a whole prompt of up to max_num_batched_tokens must fit in one step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from lmserve.engine.llm_engine import LLMEngine
from lmserve.errors import RequestRejected
from lmserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

PROBE_TOKENS = 32  # a prompt as short as a chat's first: the start runs no shape the first request does not


def fit_step_budget(engine: LLMEngine) -> int:
    """Time a prefill on this host and fit the engine's step budget to it; returns the budget."""
    budget = engine.scheduler.budget
    if not budget.fitted:
        return budget.tokens
    with _off_the_record(engine):
        rate = prefill_rate(engine)
    if rate is None:  # no probe fits this engine's context or KV pool: keep the configured budget
        return budget.tokens
    budget.fit(rate)
    log.info("step budget: %d tokens (this host prefilled %.0f tokens/s at start; refitted as steps run; %d at "
             "most; --max-num-batched-tokens fixes it)", budget.tokens, rate, budget.cfg.max_num_batched_tokens)
    return budget.tokens


@contextmanager
def _off_the_record(engine: LLMEngine) -> Iterator[None]:
    """The probes' KV blocks reach neither the KV tier nor, once they end, the prefix cache: a probe's blocks written
    to --kv-offload-dir would be found by the next start's probe and counted as prefix hits of a request that never
    was (and listed among the files a key's prompts made)."""
    tier, engine.kv.tier = engine.kv.tier, None
    try:
        yield
    finally:
        engine.kv.tier = tier
        engine.kv.reset_prefix_cache()


def prefill_rate(engine: LLMEngine) -> float | None:
    """Prompt tokens per second of a prefill on this host now (None: the probe prompt does not fit the engine)."""
    seconds = _prefill_seconds(engine, PROBE_TOKENS)
    return None if seconds is None else PROBE_TOKENS / seconds


def _prefill_seconds(engine: LLMEngine, n: int) -> float | None:
    """Seconds to prefill an n-token prompt and sample one token (None: the engine cannot take it)."""
    ids = [(1000 + i) % engine.model_config.vocab_size for i in range(n)]
    try:  # its own salt: no probe reuses another's prefix blocks
        engine.add_request(f"warm-up-{n}", ids, SamplingParams(max_tokens=1, temperature=0.0),
                           prefix_scope=f"warm-up-{n}".encode())
    except RequestRejected:
        return None
    start, paused = time.perf_counter(), engine.runner.gate.paused_s
    while engine.has_unfinished():
        engine.step()
    # a step that waited for another model's encoder step (worker/cpu_gate.py) computed no slower
    return max(time.perf_counter() - start - (engine.runner.gate.paused_s - paused), 1e-6)
