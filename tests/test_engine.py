"""The engine on the embedded model: batching invariance, chunked prefill, preemption, stops, aborts, seeds."""

from __future__ import annotations

import pytest

from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from lmserve.engine.llm_engine import LLMEngine, RequestRejected
from lmserve.sampling_params import SamplingParams

WORDS = ("The quick brown fox jumps over the lazy dog while the sun sets behind distant hills and "
         "rivers carry stories of old towns, markets, bridges and songs to the patient sea. ").split()


def prompt_of(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i) % len(WORDS)] for i in range(n_words))


PROMPTS = [prompt_of(n, i) for i, n in enumerate([3, 50, 8, 120, 17, 1, 64, 33, 90, 5, 140, 26, 11, 75, 40, 2])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


@pytest.fixture(scope="module")
def base():
    """One loaded model and tokenizer, shared by engines of different shapes."""
    eng = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=512)))
    return eng


def engine_like(base: LLMEngine, **kw) -> LLMEngine:
    cache = CacheConfig(num_blocks=kw.pop("num_blocks", 512), enable_prefix_caching=kw.pop("prefix", True))
    sched = SchedulerConfig(**kw)
    return LLMEngine(EngineConfig(cache=cache, scheduler=sched), loaded=base.loaded, tokenizer=base.tokenizer)


def run(engine: LLMEngine, prompts, params) -> dict[str, dict]:
    """Run to completion; per request id: token ids, text, finish reason, the deltas seen."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    out = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
        out[str(i)] = {"ids": [], "text": "", "deltas": [], "finish": None, "stop": None}
    while engine.has_unfinished():
        for d in engine.step():
            o = out[d.request_id] if d.index == 0 else out.setdefault(f"{d.request_id}#{d.index}", {
                "ids": [], "text": "", "deltas": [], "finish": None, "stop": None})
            o["ids"] += d.token_ids
            o["text"] += d.text
            o["deltas"].append(d.text)
            if d.finished:
                o["finish"], o["stop"] = d.finish_reason, d.stop_reason
    return out


def assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.kv.num_free_blocks == engine.num_blocks
    assert engine.kv.req_blocks == {}


@pytest.fixture(scope="module")
def alone(base):
    """Each prompt's greedy output when it runs by itself."""
    results = {}
    for i, p in enumerate(PROMPTS):
        results[str(i)] = run(base, [p], GREEDY)["0"]["ids"]
    assert_no_leak(base)
    return results


def test_batch_of_16_equals_alone(base, alone):
    out = run(base, PROMPTS, GREEDY)
    assert {k: v["ids"] for k, v in out.items()} == alone
    assert_no_leak(base)


def test_chunked_prefill_on_and_off_equal(base, alone):
    chunked = engine_like(base, max_num_batched_tokens=48)  # long prompts span several steps
    out = run(chunked, PROMPTS, GREEDY)
    assert {k: v["ids"] for k, v in out.items()} == alone
    assert_no_leak(chunked)
    whole = engine_like(base, max_num_batched_tokens=4096, enable_chunked_prefill=False)
    out = run(whole, PROMPTS, GREEDY)
    assert {k: v["ids"] for k, v in out.items()} == alone
    assert_no_leak(whole)


def test_preemption_keeps_outputs_identical(base, alone):
    small = engine_like(base, num_blocks=24, max_num_batched_tokens=256)
    out = run(small, PROMPTS, GREEDY)
    assert small.scheduler.num_preemptions > 0, "the pool was meant to be too small for the whole batch"
    assert {k: v["ids"] for k, v in out.items()} == alone
    assert_no_leak(small)


def test_seeded_sampling_is_independent_of_batch(base):
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    solo = run(base, [PROMPTS[1]], p)["0"]["ids"]
    mixed = run(base, [PROMPTS[3], PROMPTS[1], PROMPTS[0]],
                [SamplingParams(temperature=1.0, max_tokens=16), p, SamplingParams(temperature=0.7, seed=5)])
    assert mixed["1"]["ids"] == solo
    again = run(base, [PROMPTS[1]], SamplingParams(temperature=0.9, top_p=0.95, seed=1235, max_tokens=16,
                                                    ignore_eos=True))["0"]["ids"]
    assert again != solo  # a different seed gives a different sample (16 tokens at T=0.9)
    assert_no_leak(base)


def test_stop_string_across_token_boundary_is_never_streamed(base):
    full = run(base, [PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))["0"]
    toks = [base.tokenizer.decode(full["ids"][:i]) for i in range(len(full["ids"]) + 1)]
    # a stop string that starts inside one token and ends inside the next
    k = next(i for i in range(5, len(toks) - 1) if len(toks[i]) - len(toks[i - 1]) >= 2
             and len(toks[i + 1]) - len(toks[i]) >= 2)
    stop = toks[k][-1:] + toks[k + 1][len(toks[k]):len(toks[k]) + 1]
    expected = full["text"][:full["text"].index(stop)]
    out = run(base, [PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))["0"]
    assert out["finish"] == "stop" and out["stop"] == stop
    assert out["text"] == expected
    assert "".join(out["deltas"]) == expected  # nothing of the stop string ever went out
    assert_no_leak(base)


def test_stop_token_ids_min_tokens_ignore_eos(base):
    chat = base.tokenizer.encode_chat([{"role": "user", "content": "Say hello."}])
    natural = run(base, [chat], SamplingParams(temperature=0.0, max_tokens=64))["0"]
    assert natural["finish"] == "stop" and natural["ids"][-1] in base.eos_token_ids
    n = len(natural["ids"])
    longer = run(base, [chat], SamplingParams(temperature=0.0, max_tokens=64, min_tokens=n + 3))["0"]
    assert len(longer["ids"]) >= n + 3
    ignored = run(base, [chat], SamplingParams(temperature=0.0, max_tokens=n + 6, ignore_eos=True))["0"]
    assert ignored["finish"] == "length" and len(ignored["ids"]) == n + 6
    second = natural["ids"][1]
    by_id = run(base, [chat], SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[second]))["0"]
    assert by_id["finish"] == "stop" and by_id["stop"] == second and by_id["ids"] == natural["ids"][:2]
    assert_no_leak(base)


def test_abort_mid_prefill_and_mid_decode_frees_blocks(base):
    eng = engine_like(base, max_num_batched_tokens=32)
    eng.add_request("long", PROMPTS[10], GREEDY)
    eng.step()  # only the first chunk of the prompt is computed
    assert eng.kv.num_free_blocks < eng.num_blocks
    deltas = eng.abort("long")
    assert deltas and deltas[0].finished and deltas[0].finish_reason == "abort"
    assert_no_leak(eng)
    eng.add_request("dec", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=50))
    for _ in range(5):
        eng.step()
    eng.abort("dec")
    assert_no_leak(eng)


def test_impossible_requests_are_rejected_at_once(base):
    with pytest.raises(RequestRejected, match=r"exceeds the model's context of 8192"):
        base.add_request("x", "hello", SamplingParams(max_tokens=9000))
    tiny = engine_like(base, num_blocks=4)
    with pytest.raises(RequestRejected, match=r"needs \d+ KV blocks of \d+ tokens \(over every KV group\), more than "
                                              r"the whole pool's 4$"):  # blocks, not tokens: right for several groups
        tiny.add_request("y", PROMPTS[10], SamplingParams(max_tokens=16))
    with pytest.raises(RequestRejected, match="out of vocabulary"):
        base.add_request("z", [1, 2, 10**6], GREEDY)
    with pytest.raises(RequestRejected, match="empty"):
        base.add_request("w", "", GREEDY)
    assert_no_leak(base)
    assert_no_leak(tiny)


def test_n_completions_share_prompt_blocks(base):
    before = base.kv.prefix_hits
    out = run(base, [PROMPTS[10]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    assert sorted(out) == ["0", "0#1", "0#2"]
    assert all(len(o["ids"]) == 8 for o in out.values())
    assert base.kv.prefix_hits - before >= 2 * 16  # completions 1 and 2 reused the prompt's full blocks
    single = run(base, [PROMPTS[10]], SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    assert single["0"]["ids"] == out["0"]["ids"]  # completion 0 draws from the request's own seed
    assert_no_leak(base)


def test_cache_salt_separates_prefix_blocks_and_the_finished_delta_counts_hits(base):
    """Prompt blocks are shared only between requests of the same prefix_scope (the server scopes per API key)
    unless both send the same cache_salt (vLLM's, any scope's); the finished delta's num_cached_tokens is what the
    prefix cache served (the per-key metric counts it)."""
    def cached_tokens(scope: bytes, rid: str, salt: str | None = None) -> int:
        base.add_request(rid, PROMPTS[10], SamplingParams(temperature=0.0, max_tokens=1), prefix_scope=scope,
                         cache_salt=salt)
        return next(d for d in _drain(base) if d.finished).num_cached_tokens

    hits = base.kv.prefix_hits
    assert cached_tokens(b"key:team-a", "s1") == 0  # this prompt's unsalted blocks (earlier tests) are not a's
    assert cached_tokens(b"key:team-b", "s2") == 0  # nor are a's b's
    again = cached_tokens(b"key:team-a", "s3")
    assert again >= 128 and base.kv.prefix_hits - hits == again  # a's own blocks; the engine's total agrees
    assert cached_tokens(b"key:team-a", "s4", "shared-v1") == 0  # a salt is not the scope's blocks
    assert cached_tokens(b"key:team-b", "s5", "shared-v1") >= 128  # the same salt from another scope: shared
    assert cached_tokens(b"key:team-b", "s6", "shared-v2") == 0
    assert_no_leak(base)


def _drain(engine: LLMEngine) -> list:
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    return deltas


def test_kv_pool_memory_is_paid_as_blocks_are_written(base):
    """A 2.8 GiB pool costs RSS only for the blocks requests wrote; one stream at a time reuses the same blocks."""
    import psutil

    proc = psutil.Process()
    before = proc.memory_info().rss
    eng = engine_like(base, num_blocks=(3 * 2**30) // base.block_bytes)  # ~3 GiB whatever the KV dtype
    pool_bytes = eng.num_blocks * eng.block_bytes
    assert pool_bytes > 2.5 * 2**30
    built = proc.memory_info().rss
    assert built - before < 0.1 * pool_bytes  # nothing committed yet (torch.zeros wrote all of it)
    for _ in range(4):  # one stream at a time: each hits the cached prompt and reuses the blocks the last freed
        out = run(eng, [PROMPTS[10]], GREEDY)
        assert len(out["0"]["ids"]) == 20
    assert_no_leak(eng)
    touched = eng.kv.pool.num_touched_blocks
    per_request = -(-(len(eng.front.tokenize_prompt(PROMPTS[10])) + 20) // eng.block_size)
    assert touched <= per_request + 2, (touched, per_request)
    grown = proc.memory_info().rss - before
    # written blocks plus generous slack for activations and allocator noise; never the pool
    assert grown < touched * eng.block_bytes + 256 * 2**20, grown / 2**20
