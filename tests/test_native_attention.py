"""The native paged decode kernel equals the gather + SDPA path, and the engine falls back cleanly without it."""

from __future__ import annotations

import pytest
import torch

from lmserve.layers.attention.paged import decode_attention, native_decode
from lmserve.layers.kernels import native

kernel = native.native_module()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C++ compiler here: the PyTorch path is used")


def paged_case(batch: int, heads: int, kv_heads: int, dim: int, max_len: int, seed: int):
    """A random cache of 16-token blocks, shuffled block tables, mixed context lengths (>= 1)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    lens[0] = max_len
    width = -(-max_len // 16)
    num_blocks = batch * width + 3
    cache = torch.randn(2, num_blocks, 16, kv_heads, dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:batch * width].view(batch, width)
    q = torch.randn(batch, heads, dim, generator=g)
    mask = (torch.arange(width * 16)[None, :] < lens[:, None])[:, None, None, :]
    return q, cache, tables, lens, mask


@needs_kernel
@pytest.mark.parametrize("batch,heads,kv_heads,dim,max_len", [
    (1, 9, 3, 64, 1), (1, 9, 3, 64, 208), (5, 8, 8, 64, 70), (33, 9, 3, 64, 300), (7, 16, 2, 128, 129),
    (3, 32, 8, 128, 17)])
def test_kernel_equals_gather_and_sdpa(batch, heads, kv_heads, dim, max_len):
    q, cache, tables, lens, mask = paged_case(batch, heads, kv_heads, dim, max_len, seed=batch + dim)
    ref = decode_attention(q, cache, tables, mask)
    out = kernel.paged_decode_attention(q, cache[0], cache[1], tables, lens, dim ** -0.5).reshape(batch, -1)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()


@needs_kernel
def test_kernel_rows_do_not_depend_on_the_batch():
    q, cache, tables, lens, _ = paged_case(12, 9, 3, 64, 100, seed=3)
    full = kernel.paged_decode_attention(q, cache[0], cache[1], tables, lens, 0.125)
    for i in (0, 5, 11):
        one = kernel.paged_decode_attention(q[i:i + 1], cache[0], cache[1], tables[i:i + 1], lens[i:i + 1], 0.125)
        assert torch.equal(one[0], full[i])


@needs_kernel
@pytest.mark.parametrize("batch,heads,kv_heads,dim,max_len", [(5, 9, 3, 64, 70), (4, 16, 2, 128, 129)])
def test_float16_cache_reads_exactly_as_its_float32_values(batch, heads, kv_heads, dim, max_len):
    """--kv-cache-dtype float16: the kernel widens each element exactly, so its output is the float32 cache's
    output for the same (rounded) values, for decode rows and for prefill rows sharing a table."""
    q, cache, tables, lens, mask = paged_case(batch, heads, kv_heads, dim, max_len, seed=7)
    half = cache.half()
    widened = half.float()
    out = kernel.paged_decode_attention(q, half[0], half[1], tables, lens, dim ** -0.5)
    assert torch.equal(out, kernel.paged_decode_attention(q, widened[0], widened[1], tables, lens, dim ** -0.5))
    rows = torch.tensor([0, 0, 1, 1, 1][:batch] + [0] * max(0, batch - 5))  # prefill tokens: rows into the tables
    row_lens = torch.arange(1, batch + 1)
    got = kernel.paged_decode_attention(q, half[0], half[1], tables, row_lens, 0.125, rows)
    assert torch.equal(got, kernel.paged_decode_attention(q, widened[0], widened[1], tables, row_lens, 0.125, rows))
    ref = decode_attention(q, half, tables, mask)  # the SDPA path widens the gathered blocks to the queries' dtype
    assert torch.allclose(out.reshape(batch, -1), ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_float16_cache_widens_every_half_exactly():
    """Every float16 bit pattern but NaN (normals, subnormals, zeros, infinities) as one value row each context of
    length 1: its softmax weight is 1, so the output is the row as widened. The builds widen 8 at a time (F16C),
    4 at a time in integer steps (x86-64-v2), or element by element, and each must be exact."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    bits = torch.where(torch.isnan(bits), torch.zeros((), dtype=torch.float16), bits)
    n = bits.numel() // 64  # rows of 64
    cache = torch.zeros(2, n, 16, 1, 64, dtype=torch.float16)
    cache[1, :, 0, 0] = bits.view(n, 64)
    tables = torch.arange(n).view(n, 1)
    out = kernel.paged_decode_attention(torch.randn(n, 1, 64), cache[0], cache[1], tables, torch.ones(n, dtype=torch.long),
                                        0.125)
    assert torch.equal(out.view(-1), bits.float())


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("heads,kv_heads,dim,window,softcap", [
    (9, 3, 64, 0, 0.0), (16, 1, 64, 0, 0.0), (8, 8, 128, 21, 0.0), (32, 2, 256, 0, 2.5), (12, 4, 128, 40, 3.0)])
def test_prefill_tiles_equal_decode_rows_bitwise(dtype, heads, kv_heads, dim, window, softcap):
    """Prefill rows (table_rows given) run in tiles of a request's consecutive rows, each key and value row widened
    once per tile; every row's output is the bits the per-row path (decode rows) gives it, over every cache format:
    chunks after cached prefixes, of lengths that are not whole tiles (G = 1..16 query heads per kv head gives tiles
    of 48..3 rows), a one-token chunk, two chunks of one request apart in the batch, a window, a soft-cap."""
    from lmserve.layers.attention import kv_quant
    from lmserve.utils import KV_QUANT_DTYPES

    if dtype in ("int8", "fp8_e4m3") and dtype not in KV_QUANT_DTYPES:
        pytest.skip(f"no {dtype} in this torch")
    g = torch.Generator().manual_seed(dim + heads)
    chunks = [(0, 0, 37), (1, 100, 50), (2, 5, 1), (3, 260, 19), (1, 150, 6)]  # (request, cached prefix, new tokens)
    width = 280 // 16 + 1
    values = torch.randn(2, 4 * width + 5, 16, kv_heads, dim, generator=g) * 2
    cache = kv_quant.quantize(values, KV_QUANT_DTYPES[dtype]) if dtype in KV_QUANT_DTYPES else \
        values.to(getattr(torch, dtype))
    tables = torch.randperm(cache.shape[1], generator=g)[:4 * width].view(4, width)
    rows = torch.tensor([r for r, _, n in chunks for _ in range(n)])
    lens = torch.tensor([a + j + 1 for _, a, n in chunks for j in range(n)])
    q = torch.randn(len(rows), heads, dim, generator=g)
    tiled = kernel.paged_decode_attention(q, cache[0], cache[1], tables, lens, dim ** -0.5, rows, window, softcap)
    per_row = kernel.paged_decode_attention(q, cache[0], cache[1], tables[rows].contiguous(), lens, dim ** -0.5, None,
                                            window, softcap)
    assert torch.equal(tiled, per_row)


@needs_kernel
def test_kernel_refuses_what_it_cannot_run():
    q, cache, tables, lens, _ = paged_case(2, 9, 3, 64, 20, seed=4)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.paged_decode_attention(q.bfloat16(), cache[0], cache[1], tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="head_dim 64, 128 or 256"):
        kernel.paged_decode_attention(q[..., :32], cache[0][..., :32].contiguous(), cache[1][..., :32].contiguous(),
                                      tables, lens, 0.125)


@needs_kernel
@pytest.mark.parametrize("dim,window,softcap,scale", [(64, 5, None, None), (128, 20, 3.0, 0.05), (256, 16, 2.0, 0.0625),
                                                      (256, None, None, None), (64, 200, 4.0, None)])
@pytest.mark.parametrize("half", [False, True])
def test_window_softcap_and_scale_equal_the_reference(dim, window, softcap, scale, half):
    """A sliding window (the last W keys, windows ending mid-block), a soft-cap and a custom scale: the kernel equals
    the plain definition (attention_ref through the gather path), head dims 64/128/256, float32 or float16 cache."""
    from lmserve.layers.attention.context import AttnOptions
    from lmserve.layers.attention.paged import context_mask

    q, cache, tables, lens, mask = paged_case(6, 8, 2, dim, 70, seed=dim + (window or 0))
    cache = cache.half().float() if half else cache
    opts = AttnOptions(scale=scale, window=window, soft_cap=softcap)
    if window is not None:
        mask = mask & ~context_mask(lens - window, mask.shape[-1])
    ref = decode_attention(q, cache, tables, mask, opts)
    store = cache.half() if half else cache
    out = kernel.paged_decode_attention(q, store[0], store[1], tables, lens, scale or dim ** -0.5, None, window or 0,
                                        softcap or 0.0).reshape(6, -1)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), (out - ref).abs().max()


@pytest.mark.parametrize("dim", [32, 64])  # 32: the PyTorch paths; 64: the native kernel where it is built
@pytest.mark.parametrize("opts", [dict(window=6), dict(window=9, soft_cap=2.5, scale=0.1), dict(soft_cap=1.5),
                                  dict(window=5, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))])
def test_paged_attention_honours_the_options_on_every_path(dim, opts):
    """Two sequences through the paged cache, as chunks after a cached prefix and then as decode rows: each token's
    output equals ContiguousAttention over the whole sequence with the same options."""
    from lmserve.layers.attention.context import AttnOptions, ContiguousAttention
    from lmserve.layers.attention.paged import PagedAttention, PagedAttentionMetadata, PrefillChunk

    options = AttnOptions(**opts)
    g = torch.Generator().manual_seed(dim)
    lens, heads, kv_heads, bs = [23, 30], 4, 2, 8
    q, k, v = (torch.randn(sum(lens), h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    want = ContiguousAttention(lens).attend(0, q, k, v, options)
    cache = torch.zeros(2, 16, bs, kv_heads, dim)
    tables = [torch.tensor([0, 1, 2, 3]), torch.tensor([7, 5, 9, 11])]
    starts = [0, lens[0]]

    def step(rows: list[tuple[int, int, int]]) -> torch.Tensor:
        """rows: (sequence, first position, count); sequences of count 1 go first as decode rows."""
        pos = [(s, p) for s, a, n in rows for p in range(a, a + n)]
        idx = torch.tensor([starts[s] + p for s, p in pos])
        slots = torch.tensor([int(tables[s][p // bs]) * bs + p % bs for s, p in pos])
        dec = [r for r in rows if r[2] == 1]
        chunks, at = [], len(dec)
        for s, a, n in rows[len(dec):]:
            chunks.append(PrefillChunk(at, n, a + n, tables[s], torch.arange(a + n)[None, :] <= torch.arange(a, a + n)[:, None]))
            at += n
        pre = [(s, p) for s, a, n in rows[len(dec):] for p in range(a, a + n)]
        meta = PagedAttentionMetadata(
            slots, len(dec), torch.stack([tables[s] for s, _, _ in dec]) if dec else torch.zeros(0, 4, dtype=torch.long),
            None, chunks, torch.tensor([a + 1 for _, a, _ in dec], dtype=torch.long),
            torch.stack(tables) if chunks else None,
            torch.tensor([s for s, _ in pre]) if chunks else None, torch.tensor([p + 1 for _, p in pre]) if chunks else None)
        return PagedAttention([cache], meta).attend(0, q[idx], k[idx], v[idx], options), idx

    for rows in ([(0, 0, 10), (1, 0, 12)], [(0, 10, 12), (1, 12, 17)], [(0, 22, 1), (1, 29, 1)]):
        out, idx = step(rows)
        assert torch.allclose(out, want[idx], atol=2e-5, rtol=1e-4), (rows, (out - want[idx]).abs().max())


def test_fallback_when_switched_off_or_not_applicable(monkeypatch):
    q, cache, *_ = paged_case(2, 9, 3, 64, 20, seed=5)
    assert native_decode(cache.bfloat16(), q) is None  # bf16 caches use SDPA
    assert native_decode(cache.half(), q) is not None or kernel is None  # float16 caches under float32 queries
    assert native_decode(cache[..., :32], q[..., :32]) is None  # head_dim 32
    monkeypatch.setattr(native, "_on", False)  # what LMSERVE_NATIVE_KERNELS=0 sets at start-up
    assert native_decode(cache, q) is None


def test_engine_tokens_equal_with_and_without_the_kernel(monkeypatch):
    """Greedy output of the embedded model is the same through the kernel and through gather + SDPA."""
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.sampling_params import SamplingParams

    # float weights: with int8 activations (the GGUF default) a last-bit difference between the two attention
    # paths can turn into another token; float32 keeps them to the same greedy tokens
    eng = LLMEngine(EngineConfig(quantization="none", cache=CacheConfig(num_blocks=256)))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):", "1, 2, 3,"]

    def run() -> list[list[int]]:
        for i, p in enumerate(prompts):
            eng.add_request(str(i), eng.front.tokenize_prompt(p), params)
        out: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for d in eng.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        assert eng.kv.num_free_blocks == eng.num_blocks
        return [out[str(i)] for i in range(len(prompts))]

    first = run()
    monkeypatch.setattr(native, "_on", kernel is None)
    assert run() == first


def test_sinks_join_the_softmax_denominator():
    """attention_ref with sinks: each head's sink logit takes its share of the softmax and carries no value."""
    from lmserve.layers.attention.context import AttnOptions, attention_ref, visible

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 1, 8, generator=g), torch.randn(5, 1, 8, generator=g)
    sinks = torch.tensor([1.0, -0.5])
    out = attention_ref(q, k, v, visible(5, 5, None), AttnOptions(sinks=sinks)).view(5, 2, 8)
    for t in range(5):
        for h in range(2):
            scores = (q[t, h] @ k[:t + 1, 0].T) * 8 ** -0.5
            weights = torch.cat([scores, sinks[h:h + 1]]).softmax(0)[:-1]
            assert torch.allclose(out[t, h], weights @ v[:t + 1, 0], atol=1e-6)
