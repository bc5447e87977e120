"""Sliding-window layers in KV groups of their own (cache/kv_groups.py): a window group releases the blocks its
window left, so a long request's KV for those layers is bounded by the window.

Unit tests assert the exact block ids the manager hands out and releases (vLLM's style); engine tests run tiny
random Gemma 3 (5 local : 1 global layers, window 8) and Mistral (every layer windowed, window 8) models with
the hybrid cache against the same engine keeping every block (`CacheConfig(hybrid_kv_cache=False)`): greedy
tokens identical and logprobs within float tolerance, over prompts longer than the window in chunks, a
preemption and resume, a prefix-cache hit and n-gram speculative decoding; no block outlives its request."""

from __future__ import annotations

import pytest
import torch

from lmserve.cache.kv_cache_manager import KVCacheManager
from lmserve.cache.kv_groups import KVGroup, first_needed_block, kv_groups, peak_blocks
from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from lmserve.engine.llm_engine import LLMEngine
from lmserve.sampling_params import SamplingParams
from lmserve.tokenizer import Tokenizer
from tests.tiny_models import VOCAB, build_hf

NULL = 16  # KVCacheManager(16, ...).null_block: one past the pool's ids


def test_groups_follow_the_layer_pattern():
    gemma3 = ["sliding"] * 5 + ["full"]
    assert kv_groups([None if t == "full" else 512 for t in gemma3]) == \
        (KVGroup((5,)), *(KVGroup((i,), 512) for i in range(5)))
    real = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]  # Gemma 3 270M: 3 global, 15 local layers
    groups = kv_groups(real)
    assert [g.layers for g in groups] == [(5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert [g.window for g in groups] == [None] + [512] * 5
    assert kv_groups([4096] * 4) == (KVGroup((0, 1, 2, 3), 4096),)  # Mistral: one group, windowed
    assert kv_groups([None] * 3) == (KVGroup((0, 1, 2)),)
    assert kv_groups([None, 8] * 2) == (KVGroup((0, 2)), KVGroup((1, 3), 8))  # Gemma 2


def test_first_needed_block_and_peak():
    # window 4, blocks of 2: the query at position 6 sees keys 3..6, so block 1 (keys 2, 3) is still needed
    assert [first_needed_block(n, 4, 2) for n in (0, 3, 4, 5, 6, 7)] == [0, 0, 0, 1, 1, 2]
    assert first_needed_block(100, None, 2) == 0
    groups = kv_groups([4, None])
    assert peak_blocks(groups, 100, 2, None) == 100  # no step bound: a window group may hold all
    assert peak_blocks(groups, 100, 2, 1) == 50 + 3  # window 4 and one new token: 2 blocks + 1 it starts inside
    assert peak_blocks(groups, 4, 2, 1) == 4


def manager(prefix: bool = False) -> KVCacheManager:
    """Layer 1 full, layer 0 windowed (window 4), blocks of 2 tokens, 16 blocks."""
    return KVCacheManager(16, 2, prefix, kv_groups([4, None]), max_step_tokens=8)


def test_a_window_group_releases_the_blocks_its_window_left():
    kv = manager()
    tokens = list(range(100, 120))
    assert kv.allocate("a", tokens, 0, 6)  # a 6-token prompt: 3 blocks in each group
    assert kv.block_ids("a", group=0) == [0, 1, 2] and kv.block_ids("a", group=1) == [3, 4, 5]
    assert kv.table_ids("a") == [0, 1, 2, 3, 4, 5]
    assert kv.allocate("a", tokens, 6, 1)  # the query at 6 sees keys 3..6: block 0 of the window group goes
    assert kv.block_ids("a", group=0) == [0, 1, 2, 3]  # the block just freed (3) is reused first
    assert kv.block_ids("a", group=1) == [NULL, 4, 5, 6]
    assert kv.table_ids("a", 3) == [3, 6]  # what the runner's rows lack: group after group
    assert kv.allocate("a", tokens, 7, 1)  # keys 4..7 from now on: block 1 (keys 2, 3) goes, nothing new
    assert kv.block_ids("a", group=1) == [NULL, NULL, 5, 6] and kv.held_blocks("a") == 6
    assert kv.num_free_blocks == 10 and kv.usage == pytest.approx(6 / 16)
    for n in range(8, 19):  # a long decode holds at most 2 + 1 window blocks
        assert kv.allocate("a", tokens, n, 1)
        assert sum(b is not None for b in kv.req_blocks["a"][1]) <= 3
    assert kv.block_ids("a", group=1)[-3:] == [b for b in kv.block_ids("a", group=1) if b != NULL]
    kv.free("a")
    assert kv.num_free_blocks == 16 and kv.req_blocks == {} and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_trim_after_rejected_drafts_and_tables_stay_aligned():
    kv = manager()
    tokens = list(range(20))
    assert kv.allocate("a", tokens, 0, 8)
    assert kv.block_ids("a", group=0) == [0, 1, 2, 3] and kv.block_ids("a", group=1) == [4, 5, 6, 7]
    # a decode and 4 drafts: 13 slots, 7 blocks per group; the window from position 8 drops blocks 0, 1 (4, 5)
    assert kv.allocate("a", tokens, 8, 1, num_lookahead=4)
    assert kv.block_ids("a", group=0) == [0, 1, 2, 3, 4, 5, 8] and kv.num_blocks_of("a") == 7
    assert kv.block_ids("a", group=1) == [NULL, NULL, 6, 7, 9, 10, 11]
    kv.trim("a", 10)  # one draft accepted: 10 tokens, 5 blocks
    assert kv.block_ids("a", group=0) == [0, 1, 2, 3, 4] and kv.block_ids("a", group=1) == [NULL, NULL, 6, 7, 9]
    kv.free("a")
    assert kv.num_free_blocks == 16


def test_a_prefix_hit_needs_only_the_blocks_the_window_reaches():
    kv = manager(prefix=True)
    prompt = list(range(1, 13))  # 12 tokens: 6 full blocks
    assert kv.allocate("a", prompt, 0, 12)
    assert kv.block_ids("a", group=0) == [0, 1, 2, 3, 4, 5] and kv.block_ids("a", group=1) == [6, 7, 8, 9, 10, 11]
    assert kv.allocate("a", prompt + [50], 12, 1)  # keys 9.. from position 12: window blocks 0..3 released
    assert kv.block_ids("a", group=1) == [NULL] * 4 + [10, 11, 13]
    kv.free("a")
    # the whole prompt again: the full group has all 6 blocks, the window group the last 2 its window reaches
    hit = kv.find_computed("b", prompt + [60])
    assert hit.num_tokens == 12
    assert [b.block_id for b in hit.tables[0]] == [0, 1, 2, 3, 4, 5]
    assert [b and b.block_id for b in hit.tables[1]] == [None] * 4 + [10, 11]
    # evict the window group's released blocks 9 and 8 (the oldest cached, after the untouched and freed ones)
    assert kv.allocate("x", [0] * 6, 0, 6)
    assert kv.table_ids("x") == [13, 12, 14, 15, 9, 8]
    # 8 tokens: the window from position 8 needs blocks 2, 3 (ids 8, 9: gone), from 6 blocks 1, 2, from 4 blocks
    # 0, 1 (ids 6, 7: kept): the hit stops at 4 tokens although the full group holds 4 blocks
    short = kv.find_computed("c", prompt[:8] + [70])
    assert short.num_tokens == 4 and [b.block_id for b in short.tables[1]] == [6, 7]
    assert kv.allocate("c", prompt[:8] + [70], 4, 5, short)
    assert kv.block_ids("c", group=0)[:2] == [0, 1] and kv.block_ids("c", group=1)[:2] == [6, 7]
    kv.free("c")
    kv.free("x")
    assert kv.num_free_blocks == 16 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


# -- through the engine: the hybrid cache against every block kept --------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("swa"), {}

    def get(name: str):
        if name not in built:
            path, _ = build_hf(name, root)
            built[name] = (path, Tokenizer.from_pretrained(path))
        return built[name]
    return get


def engine(tiny, name: str, hybrid: bool, num_blocks: int = 256, prefix: bool = True, spec: bool = False,
           max_num_seqs: int = 4, loaded=None) -> LLMEngine:
    path, tok = tiny(name)
    cfg = EngineConfig(model=str(path), quantization="none", dtype="float32",
                       cache=CacheConfig(num_blocks=num_blocks, block_size=4, enable_prefix_caching=prefix,
                                         hybrid_kv_cache=hybrid),
                       scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=12),
                       speculative=SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1)
                       if spec else None)
    return LLMEngine(cfg, loaded=loaded, tokenizer=tok)


def prompts(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB - 3, (n,), generator=g).tolist() for n in lengths]


PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
PROMPTS = prompts([37, 5, 23, 30])  # past the window (8) and the step budget (12): chunked prefill


def run(eng: LLMEngine, batch: list[list[int]], waves: tuple = (), watch=None) -> dict:
    """Every prompt's greedy tokens and logprobs; `waves`: indices added only once the earlier ones finished."""
    out: dict = {}
    groups = [list(range(len(batch)))] if not waves else list(waves)
    for group in groups:
        for i in group:
            eng.add_request(str(i), batch[i], PARAMS)
            out[str(i)] = ([], [])
        while eng.has_unfinished():
            for d in eng.step():
                out[d.request_id][0].extend(d.token_ids)
                out[d.request_id][1].extend(lp.logprob for lp in d.logprobs or ())
            if watch is not None:
                watch(eng)
    assert eng.kv.req_blocks == {} and eng.kv.num_free_blocks == eng.num_blocks  # no block outlives its request
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)
    return out


def assert_same(ours: dict, ref: dict) -> None:
    for rid, (tokens, lps) in ref.items():
        assert ours[rid][0] == tokens, rid
        assert ours[rid][1] == pytest.approx(lps, abs=1e-5), rid


@pytest.fixture(scope="module")
def reference(tiny):
    """name -> (the all-blocks-kept engine, its outputs for PROMPTS, all at once)."""
    done = {}

    def get(name: str):
        if name not in done:
            eng = engine(tiny, name, hybrid=False, prefix=False)
            assert len(eng.kv.groups) == 1
            done[name] = eng, run(eng, PROMPTS)
        return done[name]
    return get


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_long_prompts_in_chunks_match_the_all_blocks_path(tiny, reference, name):
    ref_eng, ref = reference(name)
    eng = engine(tiny, name, hybrid=True, prefix=False, loaded=ref_eng.loaded)
    assert len(eng.kv.groups) == (6 if name == "gemma3" else 1) and eng.kv.groups[-1].window == 8
    held = []
    assert_same(run(eng, PROMPTS, watch=lambda e: held.append(max(map(e.kv.held_blocks, e.kv.req_blocks),
                                                                   default=0))), ref)
    # a request of 57 tokens keeps 15 blocks per full group; a window group at most (8 - 1 + 12) / 4 + 1 = 6
    bound = eng.kv.blocks_needed(57)
    assert bound == (15 + 5 * 6 if name == "gemma3" else 6) and max(held) <= bound
    # Gemma 3's six groups of one layer share one KV tensor: a block is one layer's page
    assert len({id(c) for c in eng.runner.kv_caches}) == (1 if name == "gemma3" else eng.model_config.num_layers)
    assert eng.block_bytes * (6 if name == "gemma3" else 1) == ref_eng.block_bytes


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_preemption_and_resume_match(tiny, reference, name):
    ref_eng, ref = reference(name)
    # 4 requests of up to 57 tokens (one holds at most 45 blocks, Mistral's 6) in 60 (10): the newest are preempted
    eng = engine(tiny, name, hybrid=True, num_blocks=60 if name == "gemma3" else 10, prefix=False,
                 loaded=ref_eng.loaded)
    assert_same(run(eng, PROMPTS), ref)
    assert eng.scheduler.num_preemptions > 0


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_a_prefix_cache_hit_matches(tiny, reference, name):
    ref_eng, ref = reference(name)
    # a pool whose kept prefixes (an eighth: 256 blocks) outlast both requests: the hits are exact
    eng = engine(tiny, name, hybrid=True, num_blocks=2048, loaded=ref_eng.loaded)
    first = run(eng, PROMPTS, waves=([0], [3]))
    assert eng.kv.prefix_hits == 0
    assert_same(first, {k: ref[k] for k in ("0", "3")})
    again = run(eng, PROMPTS, waves=([0], [3]))
    # every full block but the one holding the last prompt token: 36 of 37 tokens and 28 of 30, though the window
    # groups released all but the last blocks of each while it ran
    assert eng.kv.prefix_hits == 36 + 28
    assert_same(again, {k: ref[k] for k in ("0", "3")})


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_ngram_speculative_decoding_matches(tiny, reference, name):
    ref_eng, ref = reference(name)
    eng = engine(tiny, name, hybrid=True, spec=True, loaded=ref_eng.loaded)
    ours = run(eng, PROMPTS)
    assert eng.spec_stats.num_draft_tokens > 0
    for rid, (tokens, _) in ref.items():  # verify runs score drafts in other batches: tokens only
        assert ours[rid][0] == tokens, rid


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run; tests/test_cuda.py covers CUDA")
def test_the_triton_kernels_read_each_groups_tables(tiny, reference):
    """The Triton backend (under its interpreter here) over the same groups: a long prompt in chunks, then decodes."""
    from lmserve.layers.kernels.triton import triton_importable

    if not triton_importable():
        pytest.skip("Triton is not installed")
    ref_eng, ref = reference("gemma3")
    path, tok = tiny("gemma3")
    eng = LLMEngine(EngineConfig(model=str(path), quantization="none", dtype="float32", attention_backend="triton",
                                 cache=CacheConfig(num_blocks=64, block_size=4),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=12)),
                    loaded=ref_eng.loaded, tokenizer=tok)
    assert len(eng.kv.groups) == 6
    eng.add_request("0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0))
    tokens, lps = [], []
    while eng.has_unfinished():
        for d in eng.step():
            tokens += d.token_ids
            lps += [lp.logprob for lp in d.logprobs]
    assert tokens == ref["0"][0][:4] and lps == pytest.approx(ref["0"][1][:4], abs=1e-3)
    assert eng.kv.req_blocks == {} and eng.kv.num_free_blocks == eng.num_blocks


def test_abort_mid_request_frees_every_group_and_usage_is_the_pool(tiny, reference):
    ref_eng, _ = reference("gemma3")
    eng = engine(tiny, "gemma3", hybrid=True, prefix=False, loaded=ref_eng.loaded)
    eng.add_request("long", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(8):
        eng.step()
        load = eng.front.load()  # what /metrics reports (lmserve:kv_cache_usage_perc, num free blocks)
        held = eng.kv.held_blocks("long")
        assert load.kv_total_blocks - load.kv_free_blocks == held
        assert load.kv_usage == pytest.approx(held / eng.num_blocks)
    assert any(b is None for b in eng.kv.req_blocks["long"][1])  # its window groups did release blocks
    eng.abort("long")
    assert eng.kv.req_blocks == {} and eng.kv.num_free_blocks == eng.num_blocks
    assert eng.front.load().kv_usage == 0.0


def test_the_flag_and_the_pool_size_count_a_group_per_block():
    from lmserve.cli import build_parser
    from lmserve.config import engine_config

    assert engine_config(build_parser().parse_args(["serve"])).cache.hybrid_kv_cache
    assert not engine_config(build_parser().parse_args(["serve", "--disable-hybrid-kv-cache-manager"])
                             ).cache.hybrid_kv_cache
    from lmserve.cache.kv_groups import engine_groups

    windows = [512] * 5 + [None]
    assert len(engine_groups(windows, 4096)) == 6
    assert engine_groups(windows, 4096, hybrid=False) == engine_groups(windows, 512) == (KVGroup(tuple(range(6))),)
    # one 4,096-token request with steps of up to 512 tokens: 256 blocks of the global layer, (511 + 512) / 16 + 1
    # of each local one, against 256 blocks of all 6 layers each (a block of one layer is a sixth of the bytes)
    assert peak_blocks(engine_groups(windows, 4096), 4096, 16, 512) == 256 + 5 * 65
