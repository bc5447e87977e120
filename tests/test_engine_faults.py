"""A failed engine step fails only its requests (blocks freed, prefix hashes dropped); repeated or fatal faults kill
the engine. LLMEngine tests run the embedded model; AsyncEngine tests a fake engine (no model)."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest

from lmserve.cache.kv_cache_manager import block_hash
from lmserve.config import CacheConfig, EngineConfig
from lmserve.engine.async_engine import (
    MAX_FAILED_STEPS_IN_A_ROW,
    AsyncEngine,
    EngineDeadError,
    EngineHungError,
    StepFailedError,
)
from lmserve.engine.faults import FaultSpec, InjectedFatalFault, InjectedFault, _faulty, install_from_env, parse_fault
from lmserve.engine.llm_engine import LLMEngine
from lmserve.request import CompletionDelta, EngineRequest
from lmserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64)))


def run_all(eng: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
    return tokens


def test_parse_fault():
    assert parse_fault("") is None
    assert parse_fault("step:3") == FaultSpec("step", 3, 1)
    assert parse_fault("step:2:4") == FaultSpec("step", 2, 4)
    assert parse_fault("thread:1") == FaultSpec("thread", 1, 1)
    assert parse_fault("hang:2") == FaultSpec("hang", 2, 1)
    assert parse_fault("slow:1:200") == FaultSpec("slow", 1, 1, delay_ms=200)
    every = parse_fault("every:3")
    assert every == FaultSpec("every", 3, 1) and [n for n in range(1, 10) if every.hits(n)] == [3, 6, 9]
    for bad in ("step", "step:0", "step:x", "thread:1:2", "hang:1:2", "boom:1", "step:1:2:3", "slow:1", "slow:1:0",
                "every:0", "every:2:2"):
        with pytest.raises(ValueError, match="LMSERVE_TEST_FAULT"):
            parse_fault(bad)


def test_no_env_installs_nothing(engine, monkeypatch):
    monkeypatch.delenv("LMSERVE_TEST_FAULT", raising=False)
    execute = engine.runner.execute
    assert install_from_env(engine) is None and engine.runner.execute == execute


def test_failed_step_fails_its_requests_frees_blocks_and_forgets_prefix_hashes(engine, monkeypatch):
    prompt = list(range(100, 100 + 3 * engine.block_size))  # full blocks: published at schedule time
    expected = run_all_fresh(engine, prompt)
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", _faulty(execute, FaultSpec("step", 1)))
    engine.add_request("a", prompt, GREEDY)
    engine.add_request("b", [7, 8, 9], SamplingParams(max_tokens=4, temperature=0.0, n=2))
    with pytest.raises(InjectedFault):
        engine.step()
    assert sorted(engine.fail_step()) == ["a", "b"]
    assert not engine.has_unfinished() and not engine.children
    assert engine.kv.num_free_blocks == engine.num_blocks
    assert engine.kv.pool.lookup(block_hash(None, prompt[:engine.block_size], b"")) is None
    # The same prompt again: computed from scratch (the unwritten blocks are not reused), same greedy tokens.
    engine.add_request("again", prompt, GREEDY)
    assert run_all(engine) == {"again": expected}
    assert engine.kv.num_free_blocks == engine.num_blocks


def run_all_fresh(engine: LLMEngine, prompt: list[int]) -> list[int]:
    """Greedy tokens of `prompt` with an empty prefix cache."""
    engine.kv.reset_prefix_cache()
    engine.add_request("fresh", prompt, GREEDY)
    tokens = run_all(engine)["fresh"]
    engine.kv.reset_prefix_cache()
    return tokens


def test_failed_step_mid_decode_keeps_the_runner_rows_consistent(engine, monkeypatch):
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", _faulty(execute, FaultSpec("step", 2)))  # after the prefill
    engine.add_request("x", [5, 6, 7], GREEDY)
    engine.step()
    with pytest.raises(InjectedFault):
        engine.step()
    assert engine.fail_step() == ["x"]
    engine.add_request("y", [5, 6, 7], GREEDY)
    run_all(engine)
    assert "x" not in engine.runner.batch.index  # dropped at the next step (y's row goes at the one after)
    assert engine.kv.num_free_blocks == engine.num_blocks


class FailingEngine:
    """A fake engine: a request finishes in the step after it is added; the steps named in `fail` raise, those in
    `hang` never return, and those in `slow` first run `slow_s` seconds making progress (a layer every 20 ms)."""

    def __init__(self, fail: set[int], fatal: bool = False, hang: set[int] = frozenset(),
                 slow: set[int] = frozenset(), slow_s: float = 0.0) -> None:
        self.queued: list[str] = []
        self.fail, self.fatal, self.hang, self.steps = fail, fatal, hang, 0
        self.slow, self.slow_s, self.layers = slow, slow_s, 0
        self.last_step = None
        self.executor = types.SimpleNamespace(on_fatal=None)  # AsyncEngine hooks a rank death here

    def close(self) -> None:
        """Nothing to stop (AsyncEngine.shutdown calls it)."""

    def add(self, request: EngineRequest) -> None:
        self.queued.append(request.request_id)

    def abort(self, request_id: str) -> list[CompletionDelta]:
        self.queued = [r for r in self.queued if r != request_id]
        return []

    def has_unfinished(self) -> bool:
        return bool(self.queued)

    def progress(self) -> int:
        return self.layers

    def step(self) -> list[CompletionDelta]:
        self.steps += 1
        end = time.monotonic() + (self.slow_s if self.steps in self.slow else 0.0)
        while time.monotonic() < end:
            time.sleep(0.02)
            self.layers += 1
        if self.steps in self.hang:
            threading.Event().wait()  # never returns
        if self.steps in self.fail:
            raise (InjectedFatalFault if self.fatal else InjectedFault)("boom")
        done, self.queued = self.queued, []
        return [CompletionDelta(r, 0, [1], "x", None, finished=True) for r in done]

    def fail_step(self) -> list[str]:
        failed, self.queued = self.queued, []
        return failed


async def outcome(engine: AsyncEngine, rid: str) -> str:
    try:
        return "ok" if [d async for d in engine.generate(EngineRequest(rid, [1], SamplingParams(max_tokens=1)))] else "empty"
    except (StepFailedError, EngineDeadError) as e:
        return type(e).__name__


def run_engine(fake: FailingEngine, rids: list[str], step_timeout: float | None = None
               ) -> tuple[list[str], AsyncEngine, list]:
    engine, faults = AsyncEngine(fake, step_timeout), []
    engine.fault_listeners.append(faults.append)
    engine.start()
    try:
        results = [asyncio.run(outcome(engine, rid)) for rid in rids]
    finally:
        engine.shutdown()
    return results, engine, faults


def test_one_failed_step_fails_its_request_and_the_engine_serves_on():
    results, engine, faults = run_engine(FailingEngine({1}), ["r1", "r2"])
    assert results == ["StepFailedError", "ok"]
    assert engine.dead is None and [(f.fatal, f.request_ids) for f in faults] == [(False, ("r1",))]


def test_failed_steps_in_a_row_kill_the_engine():
    n = MAX_FAILED_STEPS_IN_A_ROW
    results, engine, faults = run_engine(FailingEngine(set(range(1, n + 1))), [f"r{i}" for i in range(n + 1)])
    assert results == ["StepFailedError"] * (n - 1) + ["EngineDeadError", "EngineDeadError"]
    assert not engine.alive and [f.fatal for f in faults] == [False] * (n - 1) + [True]


def test_a_fatal_fault_kills_the_engine_thread():
    results, engine, faults = run_engine(FailingEngine({1}, fatal=True), ["r1", "r2"])
    assert results == ["EngineDeadError", "EngineDeadError"]
    assert isinstance(engine.dead, InjectedFatalFault) and not engine._thread.is_alive()
    assert [(f.fatal, f.error) for f in faults] == [(True, "InjectedFatalFault")]


def test_a_hung_step_is_declared_dead_by_the_watchdog():
    start = time.monotonic()
    results, engine, faults = run_engine(FailingEngine(set(), hang={2}), ["r1", "r2", "r3"], step_timeout=0.3)
    assert results == ["ok", "EngineDeadError", "EngineDeadError"]  # r2's step hangs; r3 is refused
    assert time.monotonic() - start < 3  # 0.3 s timeout, checked every 0.03 s (and a 1 s join of the hung thread)
    assert isinstance(engine.dead, EngineHungError) and not engine.alive
    assert [(f.fatal, f.error) for f in faults] == [(True, "EngineHungError")]


def test_a_slow_step_that_makes_progress_is_not_hung():
    """r2's step runs 1.5 s, five times the 0.3 s timeout, bumping its progress every 20 ms: a slow host, not a
    hang. The watchdog lets it finish and the engine serves on."""
    results, engine, faults = run_engine(FailingEngine(set(), slow={2}, slow_s=1.5), ["r1", "r2", "r3"],
                                         step_timeout=0.3)
    assert results == ["ok", "ok", "ok"] and engine.dead is None and faults == []


def test_a_step_that_stops_making_progress_is_hung_however_long_it_progressed_before():
    """r2's step progresses for 0.6 s (twice the timeout), then hangs: dead a timeout after its last progress."""
    start = time.monotonic()
    results, engine, faults = run_engine(FailingEngine(set(), hang={2}, slow={2}, slow_s=0.6), ["r1", "r2"],
                                         step_timeout=0.3)
    assert results == ["ok", "EngineDeadError"] and isinstance(engine.dead, EngineHungError)
    assert [(f.fatal, f.error) for f in faults] == [(True, "EngineHungError")]
    assert time.monotonic() - start < 0.6 + 0.3 + 3  # the progress, the timeout (+ a tenth), a 1 s join


def test_no_watchdog_without_a_timeout():
    results, engine, _ = run_engine(FailingEngine(set()), ["r1"])
    assert results == ["ok"] and engine.dead is None
    assert "lmserve-watchdog" not in [t.name for t in threading.enumerate()]


# -- progress inside a step, and a step budget fitted to the host -------------------------------------------------


def test_progress_counts_every_decoder_layer_a_prefill_runs(engine):
    before = engine.progress()
    engine.add_request("p", list(range(5, 45)), SamplingParams(max_tokens=1, temperature=0.0))
    run_all(engine)  # one step: the prompt's prefill samples the only token
    assert engine.progress() - before == engine.model_config.num_layers


def test_a_slow_fault_delays_every_layer_of_its_forward_only(engine, monkeypatch):
    monkeypatch.setenv("LMSERVE_TEST_FAULT", "slow:1:20")
    execute = engine.runner.execute
    try:
        assert install_from_env(engine) == FaultSpec("slow", 1, delay_ms=20)
        engine.add_request("s", list(range(5, 45)), SamplingParams(max_tokens=2, temperature=0.0))
        start = time.perf_counter()
        engine.step()  # forward 1: every layer starts 20 ms late
        slow = time.perf_counter() - start
        start = time.perf_counter()
        run_all(engine)  # forward 2 (a decode): no delay
        assert slow >= engine.model_config.num_layers * 0.02 > time.perf_counter() - start
    finally:
        engine.runner.execute = execute


def test_warm_up_fits_the_step_budget_to_what_the_host_prefills_in_step_seconds(engine):
    from lmserve.config import SchedulerConfig
    from lmserve.engine.step_budget import fit_step_budget, prefill_rate

    rate = prefill_rate(engine)
    assert rate is not None and rate > 10  # tokens/s of the embedded 135M model: hundreds even on a loaded core
    tiny = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(
        max_num_seqs=8, step_seconds=1e-4)), loaded=engine.loaded, tokenizer=engine.tokenizer)
    assert fit_step_budget(tiny) == tiny.scheduler.budget.tokens == 32  # the floor: MIN_STEP_TOKENS
    given = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(
        max_num_batched_tokens=48)), loaded=engine.loaded, tokenizer=engine.tokenizer)
    assert fit_step_budget(given) == given.scheduler.budget.tokens == 48  # --max-num-batched-tokens is kept
    assert tiny.kv.num_free_blocks == 64 and given.kv.num_free_blocks == 64  # the probes' blocks went back
