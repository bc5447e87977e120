"""How each step's token budget is shared (sched/budget.py), as exact scheduler decisions: a short request never
waits behind a long prefill of another key (or its own), keys share by tokens not by requests or slots, and beam
search and embedding batches are budgeted by the tokens they compute, like any other request."""

from __future__ import annotations

import pytest

from lmserve.cache.kv_cache_manager import KVCacheManager
from lmserve.config import SchedulerConfig
from lmserve.pooling_params import PoolingParams
from lmserve.request import Request, TokenLogprobs
from lmserve.sampling_params import SamplingParams
from lmserve.sched.budget import Demand, StepBudget, fitted_budget, split_budget, water_fill
from lmserve.sched.scheduler import Scheduler
from lmserve.worker.model_runner import RunnerOutput


def keyed(rid: str, tenant: str, n_prompt: int, base: int = 0, max_tokens: int = 4, pooling: bool = False) -> Request:
    params = SamplingParams(max_tokens=max_tokens, pooling=PoolingParams() if pooling else None)
    return Request(rid, [base + i % 1000 for i in range(n_prompt)], params, max_tokens, frozenset({0}),
                   tenant=tenant)


def step(s: Scheduler):
    """One step whose runner samples token 7 for every request that samples (a pooled one: its vector)."""
    out = s.schedule()
    pooled = {r.request_id: [1.0] for r in out.requests if r.sample and r.pool}
    ids = [[7] if r.sample and not r.pool else [] for r in out.requests]
    s.update(out, RunnerOutput(ids, [[TokenLogprobs(t, 0.0, []) for t in row] for row in ids], embeddings=pooled))
    return out


def shares(out) -> list[tuple[str, int]]:
    return [(r.request_id, r.num_tokens) for r in out.requests]


def scheduler(budget: int, num_blocks: int = 512, max_num_seqs: int = 16, prefix_caching: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks, 16, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), kv)


def test_a_one_token_request_of_key_b_runs_in_the_step_after_it_arrives_during_key_as_3000_token_prefill():
    s = scheduler(1024)
    s.add(keyed("a", "team-a", 3000))
    assert shares(step(s)) == [("a", 1024)]  # alone: a's prefill takes the whole budget
    s.add(keyed("b", "team-b", 1, base=5000))
    out = step(s)
    assert [(r.request_id, r.start_pos, r.num_tokens, r.sample) for r in out.requests] == [
        ("a", 1024, 1023, False), ("b", 0, 1, True)]
    assert s.requests["b"].output_token_ids == [7]  # its first token came out of that step
    assert shares(step(s)) == [("a", 953), ("b", 1)]  # b decodes beside a's last chunk (2047 + 953 = 3000)


def test_a_short_request_of_the_same_key_does_not_wait_for_its_long_prefill_either():
    s = scheduler(1024)
    s.add(keyed("long", "team-a", 3000))
    step(s)
    s.add(keyed("short", "team-a", 20, base=5000))
    assert shares(step(s)) == [("long", 1004), ("short", 20)]


def test_long_prefills_of_one_key_run_one_after_another_not_all_at_once():
    """Within a key the smallest demands go first: of two long prompts the older one takes the budget (FCFS,
    as vLLM's one partial prefill), so the first finishes in 3 steps instead of both in 6."""
    s = scheduler(1024)
    s.add(keyed("a1", "team-a", 3000))
    s.add(keyed("a2", "team-a", 3000, base=5000))
    assert shares(step(s)) == [("a1", 1024)]
    assert shares(step(s)) == [("a1", 1024)]
    assert shares(step(s)) == [("a1", 952), ("a2", 72)]


def test_keys_share_the_budget_by_tokens_not_by_requests():
    """team-a has two long prompts, team-b one: each key gets half of every step, and a's half goes to its older
    prompt (counting requests or slots would give a two thirds)."""
    s = scheduler(1024)
    s.add(keyed("a1", "team-a", 3000))
    s.add(keyed("a2", "team-a", 3000, base=3000))
    s.add(keyed("b1", "team-b", 3000, base=6000))
    assert shares(step(s)) == [("a1", 512), ("b1", 512)]
    assert shares(step(s)) == [("a1", 512), ("b1", 512)]  # a2 waits: a's share goes to a1 first
    assert [r.request_id for r in s.waiting] == ["a2"]


def test_a_key_wanting_less_than_half_gets_all_it_wants_and_the_other_the_rest():
    s = scheduler(64)
    for i in range(5):
        s.add(keyed(f"a{i}", "team-a", 4, base=100 * i))
    step(s)  # a's five short prompts prefill; from now on each decodes one token a step
    s.add(keyed("b", "team-b", 3000, base=5000))
    out = step(s)
    assert shares(out) == [(f"a{i}", 1) for i in range(5)] + [("b", 59)]


def test_an_embedding_batch_of_key_a_gets_no_more_than_half_the_budget_when_key_b_waits():
    """An embedding batch is one pooling request per input, all under its key: eight 100-token inputs of team-a and
    one of team-b's share a 128-token step half and half (FCFS would give a 100 and b 28)."""
    s = scheduler(128)
    for i in range(8):
        s.add(keyed(f"a{i}", "team-a", 100, base=100 * i, pooling=True))
    s.add(keyed("b", "team-b", 100, base=5000, pooling=True))
    assert shares(step(s)) == [("a0", 64), ("b", 64)]
    out = step(s)  # the last 36 tokens of b and a0 end both (their vectors come out); a1 gets the rest of a's share
    assert shares(out) == [("a0", 36), ("b", 36), ("a1", 56)]
    assert "b" not in s.requests and s.requests["a1"].embedding is None


def test_beam_search_steps_are_budgeted_by_the_tokens_they_compute():
    """A beam search runs each live beam as a one-token request over prompt + beam, whose prompt blocks the prefix
    cache holds: eight beams of team-a then cost 8 tokens of the step, not 8 prompts, and team-b's prompt gets the
    rest of a 32-token step in the same step."""
    s = scheduler(32, prefix_caching=True)
    prompt = [3 + i for i in range(160)]  # ten full blocks
    s.add(Request("first", prompt + [1], SamplingParams(max_tokens=1), 1, frozenset({0}), tenant="team-a"))
    while s.has_unfinished():
        step(s)  # the beam search's first step: the prompt's blocks are cached
    for j in range(8):
        s.add(Request(f"beam{j}", prompt + [10 + j], SamplingParams(max_tokens=1), 1, frozenset({0}),
                      tenant="team-a"))
    s.add(keyed("b", "team-b", 100, base=5000))
    out = step(s)
    assert sorted(shares(out)) == sorted([(f"beam{j}", 1) for j in range(8)] + [("b", 24)])
    assert all(r.start_pos == 160 for r in out.requests if r.request_id.startswith("beam"))


def test_without_chunked_prefill_whole_prompts_run_in_schedule_order():
    kv = KVCacheManager(512, 16, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, enable_chunked_prefill=False), kv)
    s.add(keyed("a", "team-a", 90))
    s.add(keyed("b", "team-b", 20, base=5000))
    assert shares(step(s)) == [("a", 90)]  # b does not fit whole beside a, and is never cut
    assert shares(step(s)) == [("a", 1), ("b", 20)]


@pytest.mark.parametrize("budget,demands,expected", [
    (1024, [3000, 1], [1023, 1]),
    (1024, [3000, 3000], [512, 512]),
    (1025, [3000, 3000], [512, 513]),
    (100, [10, 20], [10, 20]),
    (64, [5, 3000, 40], [5, 30, 29]),
    (10, [], []),
])
def test_water_fill_is_max_min_fair_and_hands_out_the_whole_budget(budget, demands, expected):
    assert water_fill(budget, demands) == expected


def test_split_budget_is_fair_between_keys_and_smallest_first_within_one():
    demands = [Demand("a-long", "a", 3000), Demand("a-decode", "a", 1), Demand("b-new", "b", 600)]
    assert split_budget(1024, demands) == {"a-long": 511, "a-decode": 1, "b-new": 512}
    assert split_budget(1024, demands, chunked=False) == {"a-long": 1024, "a-decode": 0, "b-new": 0}


@pytest.mark.parametrize("rate,expected", [(500.0, 500), (5000.0, 1024), (10.0, 64), (0.0, 64)])
def test_fitted_budget_is_what_the_host_prefills_in_the_step_time_within_bounds(rate, expected):
    assert fitted_budget(1024, rate, 1.0, max_num_seqs=64) == expected
    assert fitted_budget(16, rate, 1.0, max_num_seqs=64) == 16  # never above the flag's (or default) budget


def test_step_budget_is_fitted_to_the_host_and_follows_it_from_the_steps_it_runs():
    b = StepBudget(SchedulerConfig(max_num_seqs=8, step_seconds=1.0))
    assert b.tokens == 1024  # until warm-up has measured the host
    b.fit(400.0)
    assert b.tokens == 400
    b.observe(2.0, 400)  # a chunk deep in a long prompt: 200 tokens/s; the mean with the last rate is 300
    assert b.tokens == 300
    b.observe(1.0, 100)  # under half the budget: per-step costs dominate its rate, it is not used
    assert b.tokens == 300
    for cfg in (SchedulerConfig(max_num_batched_tokens=512),  # --max-num-batched-tokens given: kept
                SchedulerConfig(max_num_batched_tokens=512, step_seconds=1.0, enable_chunked_prefill=False)):
        kept = StepBudget(cfg)
        kept.fit(10.0)
        kept.observe(100.0, 512)
        assert kept.tokens == 512
