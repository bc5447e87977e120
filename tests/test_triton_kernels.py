"""Each Triton kernel against its torch reference (layers/kernels/triton/reference.py).

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
anything imports them), at small, deliberately awkward shapes: GQA groups of 3, head_dim 24 (not a power of
two), blocks of 5 tokens, block tables shuffled over a pool whose unused blocks ("holes") hold NaN, so a read
outside the table or past a context shows up at once, windows ending mid-block. The `cuda` cases repeat them at
real model shapes and run only where a GPU is present. Tolerances: max abs difference 1e-3 in float32, 2e-2 in
bfloat16.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lmserve.layers.attention.context import AttnOptions  # noqa: E402
from lmserve.layers.blocks.rotary import cos_sin, inv_frequencies  # noqa: E402
from lmserve.layers.kernels.triton import interpreting  # noqa: E402
from lmserve.layers.kernels.triton.decode import num_kv_splits, paged_decode  # noqa: E402
from lmserve.layers.kernels.triton.moe import fused_moe, sort_by_expert  # noqa: E402
from lmserve.layers.kernels.triton.prefill import paged_prefill  # noqa: E402
from lmserve.layers.kernels.triton.reference import (  # noqa: E402
    attention_reference,
    decode_reference,
    fused_moe_reference,
    rope_write_kv_reference,
)
from lmserve.layers.kernels.triton.rope_kv import rope_write_kv  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
cuda_only = pytest.mark.skipif(not CUDA, reason="real shapes: only on a CUDA GPU")


def test_kernels_run_where_they_can():
    """On a machine without a GPU the kernels are the interpreter's (else every case here would fail to launch)."""
    assert CUDA or interpreting()


def paged_cache(num_blocks: int, page: int, kv_heads: int, dim: int, tables: list[list[int]], lens: list[int],
                dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A KV cache [2, num_blocks, page, Hkv, D] whose every slot outside the tables' contexts is NaN, and the tables
    [R, width] padded with block 0 (which is itself a hole unless some table uses it)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.full((2, num_blocks, page, kv_heads, dim), float("nan"))
    for table, n in zip(tables, lens):
        for pos in range(n):
            cache[:, table[pos // page], pos % page] = torch.randn(2, kv_heads, dim, generator=g)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    return cache.to(DEVICE, dtype), padded.to(DEVICE)


def shuffled_tables(num_blocks: int, page: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    """Disjoint tables drawn in random order from blocks 1..num_blocks-1, leaving unused blocks between them."""
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = []
    for n in lens:
        need = -(-n // page)
        assert len(free) >= need, "pool too small for the test's tables"
        tables.append(free[:need])
        free = free[need + 1:]  # skip one: a hole the next table does not use
    return tables


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "a NaN hole was read"
    diff = (out.float() - ref.float()).abs().max().item()
    assert diff <= TOL[dtype], f"max abs diff {diff:.2e} > {TOL[dtype]:.0e}"


OPTIONS = {
    "plain": lambda h: AttnOptions(),
    # window 7 over blocks of 5: every window edge falls mid-block; a cap small enough to bend the logits
    "window+cap+sinks": lambda h: AttnOptions(scale=0.3, window=7, soft_cap=2.5,
                                              sinks=torch.linspace(-1.0, 2.0, h, device=DEVICE)),
}


# every option in float32; bfloat16 with all of them at once (the interpreter's time is CI's time)
CASES = [(torch.float32, "plain"), (torch.float32, "window+cap+sinks"), (torch.bfloat16, "window+cap+sinks")]


@pytest.mark.parametrize("dtype,opt", CASES)
def test_paged_decode_matches_reference(dtype, opt):
    heads, kv_heads, dim, page = 6, 2, 24, 5
    lens = [1, 5, 13, 40, 71]  # one key; exactly one block; ending mid-block; several key tiles
    tables = shuffled_tables(48, page, lens)
    cache, bt = paged_cache(48, page, kv_heads, dim, tables, lens, dtype)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    ctx = torch.tensor(lens, device=DEVICE)
    opts = OPTIONS[opt](heads)
    ref = decode_reference(q, cache[0], cache[1], bt, ctx, opts)
    assert num_kv_splits(len(lens), kv_heads, bt.shape[1] * page) == 1  # the default here: one range
    # and more splits than a short row has keys (its empty splits must weigh nothing in the merge)
    for splits in (None, 6):
        assert_close(paged_decode(q, cache[0], cache[1], bt, ctx, opts, num_splits=splits), ref, dtype)


def test_split_count_depends_only_on_static_shapes():
    """What a captured graph fixes (rows, KV heads, table width) decides the split count; contexts never do."""
    assert num_kv_splits(1, 8, 16) == 1
    assert num_kv_splits(1, 8, 4096) == 16  # 16 ranges of 256 keys
    assert num_kv_splits(64, 8, 4096) == 1  # 512 programs already fill the GPU
    assert num_kv_splits(4, 8, 131072) == 9  # 4 * 8 * 9 >= 264 programs
    # a wider table (a graph bucket's fixed width, padded with a scratch block) gives the same answer
    heads, kv_heads, dim, page = 4, 2, 16, 4
    lens = [3, 9]
    cache, bt = paged_cache(12, page, kv_heads, dim, shuffled_tables(12, page, lens, seed=3), lens, torch.float32)
    cache[:, 0] = 0.0  # the padding block: read by no row (beyond every context)
    wide = torch.cat([bt, torch.zeros(2, 6, dtype=bt.dtype, device=DEVICE)], dim=1)
    q = torch.randn(2, heads, dim, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ctx = torch.tensor(lens, device=DEVICE)
    narrow_out = paged_decode(q, cache[0], cache[1], bt, ctx, num_splits=2)
    wide_out = paged_decode(q, cache[0], cache[1], wide, ctx, num_splits=2)
    torch.testing.assert_close(wide_out, narrow_out, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype,opt", CASES)
def test_paged_prefill_matches_reference(dtype, opt):
    """A whole prompt, a chunk after a cached prefix that ends mid-block, a one-token chunk, and a chunk longer
    than a query tile after a long prefix: queries at their own positions, causal, within the window."""
    heads, kv_heads, dim, page = 6, 2, 24, 5
    seq_lens = [19, 23, 9, 58]
    q_lens = [19, 11, 1, 37]
    tables = shuffled_tables(48, page, seq_lens, seed=4)
    cache, bt = paged_cache(48, page, kv_heads, dim, tables, seq_lens, dtype, seed=4)
    starts = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0)
    q = torch.randn(sum(q_lens), heads, dim, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, device=DEVICE)
    opts = OPTIONS[opt](heads)
    out = paged_prefill(q, cache[0], cache[1], bt, starts, lens, max(q_lens), opts)
    assert_close(out, attention_reference(q, cache[0], cache[1], bt, starts, lens, opts), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [24, 16])  # full and partial rotary (Phi-3 style)
def test_rope_write_kv_matches_reference(dtype, rotary_dim):
    tokens, heads, kv_heads, dim, page = 7, 6, 2, 24, 5
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(tokens, h, dim, generator=g).to(DEVICE, dtype) for h in (heads, kv_heads, kv_heads))
    cos, sin = cos_sin(torch.tensor([0, 3, 4, 9, 40, 41, 100]), inv_frequencies(rotary_dim, 10000.0), torch.float32)
    cos, sin = cos[:, 0].to(DEVICE), sin[:, 0].to(DEVICE)
    slots = torch.tensor([12, 0, 33, -1, 7, 8, 29], device=DEVICE)  # shuffled, one padding token (-1)
    caches = [torch.zeros(2, 8, page, kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(2)]
    ref_q = rope_write_kv_reference(q, k, v, cos, sin, caches[0][0], caches[0][1], slots)
    q_in_place = q.clone()
    out = rope_write_kv(q_in_place, k, v, cos, sin, caches[1][0], caches[1][1], slots, q_out=q_in_place)
    assert out is q_in_place
    assert_close(out, ref_q, dtype)
    assert_close(caches[1], caches[0], dtype)
    written = caches[1][0].flatten(0, 1)[slots[slots >= 0]]
    assert written.abs().sum(-1).gt(0).all()  # every real slot was written, nothing else
    assert (caches[1].flatten(1, 2).abs().sum((0, 2, 3)) > 0).sum() == 6


def test_sort_by_expert_groups_rows_in_whole_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [4, 3], [1, 0]], device=DEVICE)  # expert 2 unused
    order = sort_by_expert(ids, num_experts=5, block_m=4)
    rows, experts = order.sorted_rows.cpu(), order.block_experts.cpu()
    blocks = rows.view(-1, 4)
    flat = ids.flatten().cpu()
    assert sorted(r for r in rows.tolist() if r < 10) == list(range(10))  # every row exactly once
    for b, e in enumerate(experts.tolist()):
        real = blocks[b][blocks[b] < 10]
        if e < 0:
            assert len(real) == 0
        else:
            assert (flat[real] == e).all() and len(real) > 0
            assert real.tolist() == sorted(real.tolist())  # token order kept within an expert
    assert experts.tolist()[:4] == [0, 1, 3, 4] and set(experts.tolist()[4:]) == {-1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_reference(dtype):
    tokens, experts, top_k, hidden, inter = 13, 5, 2, 40, 24
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 3] = -30.0  # an expert no token picks
    weights, ids = logits.softmax(-1).topk(top_k)
    x, w13, w2, weights, ids = (t.to(DEVICE) for t in (x, w13, w2, weights, ids))
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    assert_close(fused_moe(x, w13, w2, weights, ids), fused_moe_reference(x, w13, w2, weights, ids), dtype)
    one = fused_moe(x[:1], w13, w2, weights[:1], ids[:1])  # a decode step of one token
    assert_close(one, fused_moe_reference(x[:1], w13, w2, weights[:1], ids[:1]), dtype)


@pytest.mark.parametrize("shared", [0, 32])
def test_triton_experts_wired_into_the_moe_layer_match_the_reference(shared):
    """The moe_kernels step with the Triton backend (layers/kernels/moe_kernels.py) gives a SparseMoE the fused kernels:
    the layer (router, Triton experts, Qwen2-MoE's shared expert) equals the token-by-token reference at batch 16 and
    batch 1, and the experts' own weights are views of the stacked w13 / w2 (one copy)."""
    from lmserve.layers.blocks.moe import reference_moe
    from lmserve.layers.kernels.moe_kernels import apply_moe_kernels
    from lmserve.layers.kernels.triton.moe import TritonExperts
    from tests.test_moe import random_moe

    moe = random_moe(shared).to(DEVICE)
    assert apply_moe_kernels(moe, triton=True) == 1 and isinstance(moe.grouped, TritonExperts)
    assert moe.experts[2].gate_up_proj.weight.data_ptr() == moe.grouped.w13[2].data_ptr()
    for tokens in (16, 1):
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
        with torch.inference_mode():
            assert_close(moe(x), reference_moe(x, moe), torch.float32)


# ---- real shapes: a CUDA GPU only ----

@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_at_llama_8b_shapes(dtype):
    heads, kv_heads, dim, page = 32, 8, 128, 16
    lens = [1, 17, 500, 2049, 4096, 8000, 33, 1000]
    tables = shuffled_tables(1200, page, lens, seed=8)
    cache, bt = paged_cache(1200, page, kv_heads, dim, tables, lens, dtype, seed=8)
    q = torch.randn(len(lens), heads, dim, device=DEVICE, dtype=dtype)
    ctx = torch.tensor(lens, device=DEVICE)
    for opts in (AttnOptions(), AttnOptions(window=4096, soft_cap=50.0, sinks=torch.zeros(heads, device=DEVICE))):
        ref = decode_reference(q, cache[0], cache[1], bt, ctx, opts)
        assert_close(paged_decode(q, cache[0], cache[1], bt, ctx, opts), ref, dtype)


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_at_llama_8b_shapes(dtype):
    heads, kv_heads, dim, page = 32, 8, 128, 16
    seq_lens, q_lens = [2048, 3000, 700], [2048, 1000, 1]
    tables = shuffled_tables(700, page, seq_lens, seed=9)
    cache, bt = paged_cache(700, page, kv_heads, dim, tables, seq_lens, dtype, seed=9)
    starts = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0)
    q = torch.randn(sum(q_lens), heads, dim, device=DEVICE, dtype=dtype)
    lens = torch.tensor(seq_lens, device=DEVICE)
    for opts in (AttnOptions(), AttnOptions(window=1024)):
        out = paged_prefill(q, cache[0], cache[1], bt, starts, lens, max(q_lens), opts)
        assert_close(out, attention_reference(q, cache[0], cache[1], bt, starts, lens, opts), dtype)


@cuda_only
@pytest.mark.cuda
def test_fused_moe_at_mixtral_like_shapes():
    tokens, experts, top_k, hidden, inter = 300, 8, 2, 1024, 704
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEVICE) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device=DEVICE) / inter ** 0.5).bfloat16()
    weights, ids = torch.randn(tokens, experts, device=DEVICE).softmax(-1).topk(top_k)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    fused_moe(x, w13, w2, weights, ids)  # compiles the kernels (outside the check below)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync (a .item(), a nonzero) would raise
    try:
        out = fused_moe(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # bf16 at K = 1024: compare relative to the output's scale
    assert (out.float() - ref.float()).abs().max().item() <= 2e-2 * ref.float().abs().max().item()
