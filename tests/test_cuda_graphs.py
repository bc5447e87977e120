"""The fixed-shape decode path that CUDA graphs capture, run eagerly on CPU (capture=False).

A captured graph reads static buffers padded to a bucket size and derives its attention mask on the
device; these tests check that those inputs give the same tokens as the ordinary step: padding rows
write only the scratch block, sequences cross block boundaries inside a fixed-shape batch, verify
runs of speculative decoding ride along, and the pool's blocks are all returned.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmserve.cache.sizing import blocks_for, gpu_kv_budget
from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from lmserve.engine.llm_engine import LLMEngine
from lmserve.layers.attention.paged import context_mask, decode_attention
from lmserve.sampling_params import SamplingParams
from lmserve.worker.cuda_graphs import bucket_for, decode_buckets
from tests.test_engine import PROMPTS, assert_no_leak, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def test_buckets_cover_every_batch_size():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert decode_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    for n in range(1, 49):
        b = bucket_for(n, decode_buckets(48))
        assert b >= n and (b == 1 or b // 2 < n or b == 48)
    assert bucket_for(49, decode_buckets(48)) is None


def test_device_mask_equals_host_mask():
    ctx = torch.tensor([1, 17, 32, 5])
    mask = context_mask(ctx, 48)
    expect = np.arange(48)[None, :] < ctx.numpy()[:, None]
    assert mask.shape == (4, 1, 1, 48) and (mask[:, 0, 0].numpy() == expect).all()
    # the reference gather + SDPA with a wider (padded) table gives the narrow table's result
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 8, 16, 2, 64, generator=g)
    q = torch.randn(4, 4, 64, generator=g)
    narrow = torch.tensor([[1, 0], [2, 3], [4, 5], [6, 0]])
    wide = torch.cat([narrow, torch.full((4, 2), 7)], dim=1)
    ref = decode_attention(q, cache, narrow, context_mask(ctx, 32))
    out = decode_attention(q, cache, wide, context_mask(ctx, 64))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def base():
    return LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=512)))


def fixed_shape_engine(base: LLMEngine, max_rows: int, **kw) -> LLMEngine:
    spec = kw.pop("spec", None)
    eng = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=512), scheduler=SchedulerConfig(**kw), speculative=spec),
                    loaded=base.loaded, tokenizer=base.tokenizer)
    eng.runner.enable_decode_graphs(max_rows, blocks_for(eng.max_model_len, eng.block_size), capture=False)
    return eng


def count_graph_steps(eng: LLMEngine) -> list[int]:
    """Wrap the runner's fixed-shape path to record each step's row count (it still runs)."""
    seen: list[int] = []
    graphs = eng.runner.graphs
    real = graphs.run

    def counting(inputs):
        seen.append(len(inputs.input_ids))
        return real(inputs)

    graphs.run = counting
    return seen


def test_padded_decode_steps_equal_the_ordinary_step(base):
    prompts = PROMPTS[:7]  # 7 rows: a bucket of 8 with one padding row; prompts cross 16-token blocks
    ref = run(LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=512)), loaded=base.loaded,
                        tokenizer=base.tokenizer), prompts, GREEDY)
    eng = fixed_shape_engine(base, max_rows=8)
    seen = count_graph_steps(eng)
    scratch = [c[:, -1].clone() for c in eng.runner.kv_caches]
    out = run(eng, prompts, GREEDY)
    assert {k: v["ids"] for k, v in out.items()} == {k: v["ids"] for k, v in ref.items()}
    assert seen and set(seen) & {3, 5, 6, 7}, seen  # batches that pad up to a bucket did run
    assert any(not torch.equal(c[:, -1], s) for c, s in zip(eng.runner.kv_caches, scratch))  # padding wrote there
    assert_no_leak(eng)


def test_larger_steps_and_prefills_fall_back_to_eager(base):
    eng = fixed_shape_engine(base, max_rows=2)
    seen = count_graph_steps(eng)
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    out = run(eng, PROMPTS[:4], params)
    ref = run(base, PROMPTS[:4], params)
    assert {k: v["ids"] for k, v in out.items()} == {k: v["ids"] for k, v in ref.items()}
    # 4 decodes at once ran eagerly; once two requests ended, the other two took the fixed-shape path
    assert seen and max(seen) <= 2, seen
    assert_no_leak(eng)


def test_verify_runs_of_speculative_decoding_use_fixed_shapes(base):
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    prompt = "Repeat this: one two three four five six seven eight. one two three four five six"
    ref = run(base, [prompt], SamplingParams(temperature=0.0, max_tokens=30))
    eng = fixed_shape_engine(base, max_rows=16, spec=spec)
    seen = count_graph_steps(eng)
    out = run(eng, [prompt], SamplingParams(temperature=0.0, max_tokens=30))
    assert out["0"]["ids"] == ref["0"]["ids"]
    assert any(n > 1 for n in seen), seen  # a verify run (1 + drafts rows) went through the padded path
    assert_no_leak(eng)


def test_gpu_kv_budget_is_the_share_left_after_the_profiled_peak():
    gib = 2**30
    # an 80 GiB GPU at 0.9: 72 GiB, less 3 GiB peak of weights + a full step, less 1 GiB CUDA context
    assert gpu_kv_budget(80 * gib, 0.9, 3 * gib, 1 * gib) == 68 * gib
    assert gpu_kv_budget(80 * gib, 0.05, 3 * gib, 1 * gib) == 0  # never negative: the engine then refuses
