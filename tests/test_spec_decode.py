"""Speculative decoding: n-gram and draft-model drafts, verified losslessly.

Greedy output must equal the engine without speculation token for token (float32, alone and in mixed
batches, with chunked prefill, preemption, prefix caching, stop strings, n > 1, logprobs and
max_tokens inside a run); sampled output must keep the target distribution (chi-square, with a
negative control); the scheduler's bookkeeping (drafts in the budget, KV trim) is checked exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from lmserve import LLM, SamplingParams
from lmserve.cache.kv_cache_manager import KVCacheManager
from lmserve.config import SchedulerConfig, SpeculativeConfig
from lmserve.request import Request, TokenLogprobs
from lmserve.sample.rejection import accept_drafts
from lmserve.sched.scheduler import Scheduler
from lmserve.spec.ngram import propose_ngram
from lmserve.spec.policy import REMEASURE_STEPS, SEEDED_ROW_COST, Acceptance, DraftPolicy, StepCost, best_plan
from lmserve.worker.model_runner import RunnerOutput
from tests.conftest import write_tiny_llama

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PASSAGE = ("The lighthouse keeper climbed the narrow stairs every evening at six, carrying a lamp, a "
           "notebook and a flask of tea. He wrote down the wind, the colour of the sea and the ships that "
           "passed, and he never missed a night in forty years.")


def chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


# -- proposer, back-off, verifier (no model) ------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match():
    t = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7, 3, 4, 2, 6, 7], dtype=np.int64)
    assert propose_ngram(t, 2, 4, 3) == [3, 4, 2]  # suffix [6, 7]: latest earlier match is at 7..8
    assert propose_ngram(t, 2, 4, 10) == [3, 4, 2, 6, 7]  # capped by the sequence's end
    assert propose_ngram(np.array([1, 2, 3, 4]), 2, 3, 4) == []  # no repeat: no drafts
    assert propose_ngram(np.array([1, 2, 3, 9, 2, 3]), 1, 1, 2) == [9, 2]  # n = 1 looks up the last token


def _table(**seconds_by_rows: float):
    """T(R) from a table {R: seconds}, through StepCost's interpolation."""
    policy = DraftPolicy()
    for rows, t in seconds_by_rows.items():
        policy.cost.record(int(rows[1:]), t, 0)
    return policy.cost.estimate


def test_plan_drafts_only_what_pays_for_its_rows():
    # the AVX2 host's numbers: a 5-row verify costs 1.77x a 1-row decode
    avx2 = _table(r1=10.0, r2=10.5, r5=17.7)
    assert best_plan([0.22], [4], 1, avx2) == [1]  # sampled chat: one draft pays (1.22 tokens for 1.05x), two do not
    assert best_plan([0.9], [4], 1, avx2) == [4]  # copying: 4.1 tokens for 1.77x
    assert best_plan([0.22], [4], 1, _table(r1=10.0, r2=20.0)) == [0]  # a row as dear as a step: never
    # a kernel that takes up to 8 rows at the price of one: every draft under that edge is free
    flat = _table(r1=10.0, r8=10.0, r9=20.0, r16=21.0)
    assert best_plan([0.5], [7], 1, flat) == [7]
    assert best_plan([0.9, 0.3], [4, 4], 2, flat) == [4, 2]  # the likeliest rows first, within 8 rows
    assert best_plan([0.9, 0.3], [4, 4], 2, _table(r2=10.0, r10=10.0)) == [4, 4]


def test_acceptance_falls_with_rejections_and_returns_to_the_prior():
    a = Acceptance()
    prior = a.alpha
    for _ in range(5):
        a.record(4, 0)
    assert a.alpha < 0.2 < prior
    for _ in range(60):
        a.sat_out()  # sitting out, old evidence fades: the request gets to try again
    assert a.alpha > 0.6  # close enough to the prior to draft again where rows are cheap
    for _ in range(5):
        a.record(4, 4)
    assert a.alpha > prior


def test_policy_measures_the_base_step_before_drafting_and_again_later():
    policy = DraftPolicy()
    assert policy.plan(["a"], [4], 1) == [0]  # T(1) never measured: this step measures it
    policy.record_step(1, 0.010, has_prefill=False)
    assert policy.plan(["a"], [4], 1) == [4]  # rows above 1 are priced as T(1) until measured
    policy.record_step(5, 0.030, has_prefill=False)  # 4 drafts made the step 3x: at alpha 0.75 that loses
    assert policy.plan(["a"], [4], 1) in ([1], [2])
    policy.record_step(5, 0.010, has_prefill=True)  # a step with prefill says nothing about decode rows
    assert policy.cost.seconds[5] == 0.030
    for _ in range(REMEASURE_STEPS):
        policy.record_step(2, 0.012, has_prefill=False)
    assert policy.plan(["a"], [4], 1) == [0]  # T(1) is stale: measured again before drafting on
    # a seeded sampled request ignores measured costs (its draft counts must not depend on its batch)
    assert policy.plan(["a", "s"], [4, 4], 2, seeded=[False, True]) == [0, 4]


def _first_token_counts(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, trials: int,
                        accept_all: bool = False) -> np.ndarray:
    """Histogram of the token kept at one position over `trials` independent verifications."""
    probs = p.expand(trials, -1)
    d = drafts.expand(trials)
    qq = None if q is None else q.expand(trials, -1)
    accepted, residual = accept_drafts(probs, d, qq, torch.rand(trials))
    if accept_all:  # negative control: a verifier that trusts every draft
        accepted = torch.ones_like(accepted)
    own = torch.multinomial(residual, 1).squeeze(1)
    kept = torch.where(accepted, d, own)
    return np.bincount(kept.numpy(), minlength=p.shape[-1])


@pytest.mark.parametrize("drafter", ["one-hot", "sampled"])
def test_rejection_sampling_keeps_the_target_distribution(drafter):
    torch.manual_seed(0)
    trials = 60_000
    p = torch.tensor([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10]])
    if drafter == "one-hot":
        q, drafts = None, torch.tensor([2])
    else:
        q = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.10, 0.10]])
        drafts = torch.multinomial(q.expand(trials, -1), 1).squeeze(1)
    counts = _first_token_counts(p, drafts, q, trials)
    assert chisquare(counts, p[0].numpy() * trials).pvalue > 1e-3
    bad = _first_token_counts(p, drafts, q, trials, accept_all=True)  # the test can tell a wrong verifier
    assert chisquare(bad, p[0].numpy() * trials).pvalue < 1e-6


# -- scheduler bookkeeping --------------------------------------------------------------------------

def _result(out, tokens: dict[str, list[int]]) -> RunnerOutput:
    ids = [tokens.get(r.request_id, []) if r.sample else [] for r in out.requests]
    return RunnerOutput(ids, [[TokenLogprobs(t, -0.5, []) for t in row] for row in ids])


def test_drafts_are_scheduled_verified_and_rolled_back():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    req = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20), 20, frozenset({0}))
    s.add(req)
    s.update(out := s.schedule(), _result(out, {"a": [7]}))  # prefill: 6 tokens, first output 7
    assert kv.block_ids("a") == [0, 1]
    req.spec_token_ids = [8, 9, 10, 11]
    out = s.schedule()
    r = out.requests[0]
    # runs 7 (sampled last step: the one token the runner's row lacks, at position 6), then the four drafts
    assert (r.new_token_ids, r.token_start, r.start_pos, r.spec_token_ids, r.num_known) == ([7], 6, 6, [8, 9, 10, 11], 1)
    assert kv.block_ids("a") == [0, 1, 2]  # room for positions 6..10
    s.update(out, _result(out, {"a": [8, 42]}))  # draft 8 accepted, 9 rejected: the verifier sampled 42
    assert req.output_token_ids == [7, 8, 42] and req.num_computed_tokens == 8
    assert kv.block_ids("a") == [0, 1, 2]  # position 8 (the 42) still needs block 2
    # block 1 held drafts when it was allocated: it is published only once all its tokens are known
    assert kv.find_computed("b", req.all_token_ids[:9]).num_tokens == 4
    s.schedule()  # this step writes position 8; positions 4..7 are all known tokens now
    assert kv.find_computed("b", req.all_token_ids[:9]).num_tokens == 8


def _prefilled(budget: int) -> tuple[KVCacheManager, Scheduler, Request]:
    """A scheduler over 16 blocks of 4 with request "a" (prompt 1, 2, 3) past its prefill (output: 4)."""
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=20), 20, frozenset({0}))
    s.add(req)
    s.update(out := s.schedule(), _result(out, {"a": [4]}))
    return kv, s, req


def test_trim_frees_blocks_that_only_rejected_drafts_reached():
    kv, s, req = _prefilled(budget=64)
    req.spec_token_ids = [5, 6, 7, 8, 9, 10]  # positions 4..9: blocks 1 and 2
    out = s.schedule()
    assert kv.block_ids("a") == [0, 1, 2]
    s.update(out, _result(out, {"a": [77]}))  # first draft rejected
    assert kv.block_ids("a") == [0, 1] and kv.num_free_blocks == 14


def test_stop_inside_a_run_drops_the_rest_and_budget_caps_drafts():
    kv, s, req = _prefilled(budget=3)
    req.spec_token_ids = [5, 0, 7, 8]
    out = s.schedule()
    assert out.requests[0].spec_token_ids == [5, 0]  # 1 known + 2 drafts fill the budget of 3
    s.update(out, _result(out, {"a": [5, 0, 9]}))  # stop id 0 accepted as the 2nd token: 9 is dropped
    assert req.output_token_ids == [4, 5, 0] and req.status.finished and kv.num_free_blocks == 16


# -- the engine: lossless greedy ------------------------------------------------------------------

class SteadyCost(StepCost):
    """Step costs as a quiet host measures them (a verify row at a fixed share of a step), whatever the load.

    The engine tests below check that drafts are verified losslessly and accepted where the text repeats; how many
    rows are worth drafting is the policy's, from the host's step times, which a loaded CI host makes noisy (a
    single slow 5-row step priced drafting out of a 48-token test on a 2-core Zen 5 beside another test worker).
    The policy's own tests above cover its use of measured costs."""

    def estimate(self, rows: int) -> float:
        return 1.0 + SEEDED_ROW_COST * (rows - 1)


@pytest.fixture(scope="module")
def engines():
    base = LLM(dtype="float32", num_threads=2, kv_cache_memory=256 * 2**20)
    ngram = LLM(dtype="float32", num_threads=2, kv_cache_memory=256 * 2**20, speculative_config=NGRAM)
    ngram.engine.speculator.policy.cost = SteadyCost()
    return base, ngram


def _compare(a, b) -> None:
    for x, y in zip(a, b):
        for o1, o2 in zip(x.outputs, y.outputs):
            assert o1.token_ids == o2.token_ids
            assert (o1.text, o1.finish_reason, o1.stop_reason) == (o2.text, o2.finish_reason, o2.stop_reason)
            if o1.logprobs is not None:
                assert [t.token_id for t in o1.logprobs] == [t.token_id for t in o2.logprobs]
                assert np.allclose([t.logprob for t in o1.logprobs], [t.logprob for t in o2.logprobs], atol=1e-5)
                assert [[i for i, _ in t.top] for t in o1.logprobs] == [[i for i, _ in t.top] for t in o2.logprobs]


def test_ngram_greedy_equals_no_speculation_alone_and_batched(engines):
    base, ngram = engines
    prompts = [chat(base, f"Repeat the following text exactly:\n{PASSAGE}"),
               chat(base, "Write a haiku about autumn."),
               chat(base, f"Fix the typo and repeat: {PASSAGE.replace('keeper', 'keeepr')}")]
    greedy = SamplingParams(temperature=0, max_tokens=48)
    alone_base = [base.generate(p, greedy, use_tqdm=False)[0] for p in prompts[:1]]
    alone = [ngram.generate(p, greedy, use_tqdm=False)[0] for p in prompts[:1]]
    _compare(alone_base, alone)
    stats = ngram.engine.spec_stats
    assert stats.num_accepted_tokens > 20, "copying a passage should accept many drafts"
    mixed = [greedy, SamplingParams(temperature=0, max_tokens=37, logprobs=3, stop=["forty"]),
             SamplingParams(temperature=0, max_tokens=40, n=2, frequency_penalty=0.3, presence_penalty=0.2),
             SamplingParams(temperature=0, max_tokens=13, repetition_penalty=1.3, logprobs=0),
             SamplingParams(temperature=0, max_tokens=30, min_tokens=25, stop=["."])]
    batch_prompts = [prompts[i % 3] for i in range(len(mixed))]
    _compare(base.generate(batch_prompts, mixed, use_tqdm=False), ngram.generate(batch_prompts, mixed, use_tqdm=False))


def test_ngram_with_chunked_prefill_preemption_and_prefix_cache(engines):
    base, _ = engines
    small = dict(dtype="float32", num_threads=2, num_blocks=14, block_size=16, max_num_batched_tokens=48)
    plain = LLM(**small)
    spec = LLM(**small, speculative_config=NGRAM)
    prompt = chat(base, f"Repeat the following text exactly:\n{PASSAGE}")
    prompts = [prompt, prompt, chat(base, f"Repeat this: {PASSAGE[:120]}"), prompt]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    _compare(expected, got)
    assert spec.engine.scheduler.num_preemptions > 0, "the pool is meant to be too small for all four"
    assert spec.engine.spec_stats.num_accepted_tokens > 0 and spec.engine.kv.num_free_blocks == 14


def test_seeded_sampling_reproduces_with_speculation(engines):
    _, ngram = engines
    prompt = chat(ngram, f"Repeat the following text exactly:\n{PASSAGE}")
    p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=11, n=2)
    a = ngram.generate(prompt, p, use_tqdm=False)[0]
    b = ngram.generate([prompt, chat(ngram, "Hi")], [p, SamplingParams(max_tokens=20)], use_tqdm=False)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids


def test_draft_model_equal_to_target_accepts_every_draft(engines, smol_path):
    base, _ = engines
    draft = LLM(dtype="float32", num_threads=2, kv_cache_memory=128 * 2**20,
                speculative_config={"method": "draft_model", "model": str(smol_path), "num_speculative_tokens": 3})
    prompts = [chat(base, "Write a short story about a lighthouse keeper."), chat(base, "List three fruits.")]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _compare(base.generate(prompts, params, use_tqdm=False), draft.generate(prompts, params, use_tqdm=False))
    s = draft.engine.spec_stats
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens


def test_draft_model_with_another_tokenizer_is_refused(tmp_path, smol_path):
    write_tiny_llama(tmp_path / "tiny")
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(smol_path), dtype="float32", kv_cache_memory=64 * 2**20,
            speculative_config={"method": "draft_model", "model": str(tmp_path / "tiny")})


def test_bad_speculative_config_is_named():
    with pytest.raises(ValueError, match="unknown speculative config keys: num_spec_tokens"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_spec_tokens": 3})
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.from_dict({"method": "medusa"})


# -- the engine: sampled output keeps the target distribution -------------------------------------

def test_sampled_speculation_matches_the_exact_distribution(tmp_path):
    """Tiny random model, top-k 4: the exact joint law of the first two tokens is computable."""
    from lmserve.layers.attention.context import ContiguousAttention

    path = tmp_path / "tiny"
    write_tiny_llama(path)
    llm = LLM(str(path), dtype="float32", num_threads=2, num_blocks=512,
              speculative_config={"method": "draft_model", "model": str(path), "num_speculative_tokens": 2})
    model = llm.engine.loaded.model
    prompt = [5, 9, 17, 33, 65, 129]

    def top4(ids: list[int]) -> tuple[list[int], np.ndarray]:
        with torch.inference_mode():
            x = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)),
                                           ContiguousAttention([len(ids)])))[-1]
        v, i = x.topk(4)
        return i.tolist(), v.softmax(-1).double().numpy()

    first_ids, first_p = top4(prompt)
    exact = {}
    for t1, p1 in zip(first_ids, first_p):
        ids2, p2 = top4(prompt + [t1])
        exact.update({(t1, t2): p1 * q for t2, q in zip(ids2, p2)})
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, n=16, ignore_eos=True)
    outs = llm.generate([prompt] * 200, params, use_tqdm=False)
    pairs = [tuple(o.token_ids[:2]) for r in outs for o in r.outputs]
    cells = sorted(exact)
    observed = np.array([sum(1 for p in pairs if p == c) for c in cells])
    assert observed.sum() == len(pairs), "every sample must fall in the top-4 x top-4 support"
    assert llm.engine.spec_stats.num_accepted_tokens > 0 and \
        llm.engine.spec_stats.num_accepted_tokens < llm.engine.spec_stats.num_draft_tokens
    expected = np.array([exact[c] for c in cells])
    assert chisquare(observed, expected / expected.sum() * len(pairs)).pvalue > 1e-3


# -- the server -----------------------------------------------------------------------------------

def test_server_streams_speculative_runs_and_exports_acceptance_metrics():
    """`lmserve serve --speculative-config` through the official client: the streamed text equals the
    non-streamed text, some chunks carry several tokens, and the spec_decode counters add up."""
    import json

    import openai

    from tests.server_util import running_server

    with running_server("--speculative-config", json.dumps(NGRAM), "--dtype", "float32") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        model = client.models.list().data[0].id
        prompt = f"Repeat the following text exactly:\n{PASSAGE}"
        msgs = [{"role": "user", "content": prompt}]
        whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=40, temperature=0)
        chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=40, temperature=0,
                                                     stream=True, logprobs=True))
        pieces = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
        assert max(len(p.logprobs.content) for p in pieces) > 1, "a verify step streams several tokens at once"
        drafts = server.metric("lmserve:spec_decode_num_draft_tokens_total")
        accepted = server.metric("lmserve:spec_decode_num_accepted_tokens_total")
        by_pos = [server.metric("lmserve:spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"')
                  for i in range(4)]
        assert 0 < accepted <= drafts and sum(by_pos) == accepted and by_pos == sorted(by_pos, reverse=True)
        assert server.metric("lmserve:spec_decode_num_drafts_total") > 0


def test_drafts_are_dropped_before_anyone_is_preempted_for_them():
    kv = KVCacheManager(2, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=5), 5, frozenset({0}))
    s.add(req)
    s.update(out := s.schedule(), _result(out, {"a": [4]}))
    req.spec_token_ids = [5, 6, 7, 8, 9]  # positions 3..8 would need blocks 0-2: the pool has 2
    out = s.schedule()
    assert out.requests[0].spec_token_ids == [] and not out.preempted_ids and kv.block_ids("a") == [0]


def test_ngram_greedy_with_a_reasoning_budget_equals_no_speculation(engines):
    """Drafts stop where the budget forces "</think>" (ReasoningBudget.draft_room), and rows through drafts mask as
    step by step: the same tokens with and without speculation, the tag forced at the same place."""
    base, ngram = engines
    before = ngram.engine.spec_stats.num_accepted_tokens
    think = [p + base.tokenizer.encode("<think>\n", add_special_tokens=False)
             for p in (chat(base, f"Repeat the following text exactly:\n{PASSAGE}"), chat(base, "Name a colour."))]
    budgets = [SamplingParams(temperature=0, max_tokens=72, reasoning_tags=("<think>", "</think>"),
                              reasoning_budget=b) for b in (0, 9, 40)]
    prompts = [think[i % 2] for i in range(len(budgets))]
    want = base.generate(prompts, budgets, use_tqdm=False)
    _compare(want, ngram.generate(prompts, budgets, use_tqdm=False))
    end = base.tokenizer.encode("</think>", add_special_tokens=False)
    for out, p in zip(want, budgets):
        reasoning, tag, answer = out.outputs[0].text.partition("</think>")
        assert tag and answer.strip(), out.outputs[0].text
        ids = out.outputs[0].token_ids
        closed = next(i + len(end) for i in range(len(ids)) if ids[i:i + len(end)] == end)
        assert closed <= max(p.reasoning_budget, len(end)), (closed, p.reasoning_budget)
    assert ngram.engine.spec_stats.num_accepted_tokens > before  # drafts ran (and were cut, not dropped)
