"""Paged decode attention (flash-decoding): one query row per sequence, K/V read in place through the block table.

Stage 1 splits each sequence's keys into `num_splits` ranges; one program per (row, KV head, split) walks its
range in tiles of BLOCK_N keys, each key's address found through the block table (any block size, blocks in
any order), and keeps an online softmax for all the query heads of its GQA group at once (K/V read once per
group). It leaves a normalised partial output and its log-sum-exp per split. Stage 2 merges the splits (and
an attention sink's share of the denominator); with one split (short tables, or rows enough to fill the GPU)
stage 1 finishes the output itself and stage 2 does not run. The ranges are cut on the device from each row's context
length; the split count depends only on static shapes (rows, KV heads, block-table width), so a CUDA graph
captured for a batch size stays valid for every context length it replays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserve.layers.attention.context import AttnOptions
from lmserve.layers.kernels.triton import dot_flags, interpreting

MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256  # fewer keys than this per program: the merge costs more than the parallelism gains
TARGET_PROGRAMS = 264  # ~2 per SM on an H100 (132 SMs): enough programs in flight to hide memory latency


def num_kv_splits(rows: int, kv_heads: int, max_keys: int) -> int:
    """Splits per sequence: enough programs to fill the GPU, never ranges shorter than MIN_KEYS_PER_SPLIT keys.

    Only static shapes go in (rows and block-table width are fixed inside a captured graph)."""
    by_length = triton.cdiv(max_keys, MIN_KEYS_PER_SPLIT)
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, max(1, rows * kv_heads))
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


@triton.jit
def kv_tile(K, V, table_row, t, t_ok, d, d_ok, page_size, stride_tn, stride_b, stride_t, UPCAST: tl.constexpr):
    """Keys and values [BLOCK_N, BLOCK_D] of one sequence's tokens t, found through its block-table row (zeros where
    not t_ok). K and V point at one KV head; the two caches share one layout (strides)."""
    block = tl.load(table_row + (t // page_size) * stride_tn, mask=t_ok, other=0).to(tl.int64)
    offsets = (block * stride_b + (t % page_size) * stride_t)[:, None] + d[None, :]
    ok = t_ok[:, None] & d_ok[None, :]
    k = tl.load(K + offsets, mask=ok, other=0.0)
    v = tl.load(V + offsets, mask=ok, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@triton.jit
def attend_tile(q, k, v, visible, m, l, acc, scale, soft_cap, USE_CAP: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of an online softmax: the scores of q [M, D] against k [N, D] (scaled, soft-capped, -inf where
    not `visible` [M or 1, N]) folded into each row's running max m [M], sum l [M] and output acc [M, D]."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
    if USE_CAP:  # soft_cap * tanh(s / soft_cap), tanh written with exp (which the interpreter has too)
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet (a window's edge)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)


def kv_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, token, head) strides of the K and V caches [num_blocks, block_size, Hkv, D], which must agree."""
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K and V caches: one layout, D contiguous"
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


@triton.jit
def _decode_split_kernel(
        Q, K, V, BlockTables, ContextLens, PartOut, PartLse, Sinks, Out,
        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_tn,
        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
        scale, soft_cap, window, page_size,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr,
        USE_SINKS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ContextLens + row).to(tl.int32)
    first = tl.maximum(ctx - window, 0) if USE_WINDOW else 0  # the query sits at position ctx - 1
    per_split = tl.cdiv(ctx - first, NUM_SPLITS)
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_ok, d_ok = g < GROUP, d < HEAD_DIM
    q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < hi
        k, v = kv_tile(K + kv_head * stride_kh, V + kv_head * stride_kh, BlockTables + row * stride_tb, t, t_ok, d,
                       d_ok, page_size, stride_tn, stride_kb, stride_kt, UPCAST)  # [BLOCK_N, BLOCK_D]
        m, l, acc = attend_tile(q, k, v, t_ok[None, :], m, l, acc, scale, soft_cap, USE_CAP, PRECISION)
    out_ok = g_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:  # the whole context in this program: finish here, no merge (l > 0: ctx >= 1)
        if USE_SINKS:
            sink = tl.load(Sinks + heads, mask=g_ok, other=0.0).to(tl.float32)
            m_all = tl.maximum(m, sink)
            shrink = tl.exp(m - m_all)
            acc = acc * shrink[:, None]
            l = l * shrink + tl.exp(sink - m_all)
        tl.store(Out + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 (acc / l[:, None]).to(Out.dtype.element_ty), mask=out_ok)
    else:
        has_keys = l > 0  # a split past a short context has none: it weighs nothing in the merge
        out = acc / tl.where(has_keys, l, 1.0)[:, None]
        lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, l, 1.0)), float("-inf"))
        tl.store(PartOut + row * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :], out,
                 mask=out_ok)
        tl.store(PartLse + row * stride_lb + heads * stride_lh + split, lse, mask=g_ok)


@triton.jit
def _merge_splits_kernel(PartOut, PartLse, Sinks, Out, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         stride_ob, stride_oh, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_SINKS: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok, d_ok = s < NUM_SPLITS, d < HEAD_DIM
    lse = tl.load(PartLse + row * stride_lb + head * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: the split holding the query's own key is never empty
    if USE_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32)
        m = tl.maximum(m, sink)
    w = tl.exp(lse - m)  # [BLOCK_S]
    den = tl.sum(w, 0)
    if USE_SINKS:
        den += tl.exp(sink - m)
    part = tl.load(PartOut + row * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / den
    tl.store(Out + row * stride_ob + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, opts: AttnOptions | None = None, num_splits: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] attending over k/v_cache [num_blocks, block_size, Hkv, D] through block_tables [B, W]
    (row b's keys: its first context_lens[b] tokens) -> [B, H, D] in q's dtype. `num_splits`: split-K
    ranges per row (default: `num_kv_splits` of the static shapes; with one, no merge runs)."""
    opts = opts or AttnOptions()
    rows, heads, dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert q.stride(2) == 1, "head_dim must be contiguous"
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if rows == 0:
        return out
    splits = num_splits or num_kv_splits(rows, kv_heads, block_tables.shape[1] * page)
    # float32 partial outputs and log-sum-exps of each split (never written with one split)
    part = torch.empty(rows, heads, splits if splits > 1 else 0, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows, heads, splits if splits > 1 else 0, dtype=torch.float32, device=q.device)
    sinks = opts.sinks if opts.sinks is not None else lse  # any tensor: not read without USE_SINKS
    block_d = max(16, triton.next_power_of_2(dim))
    _decode_split_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, part, lse, sinks, out,
        q.stride(0), q.stride(1), *kv_strides(k_cache, v_cache), block_tables.stride(0), block_tables.stride(1),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        opts.scale if opts.scale is not None else dim ** -0.5, opts.soft_cap or 1.0, opts.window or 0, page,
        GROUP=heads // kv_heads, BLOCK_G=max(16, triton.next_power_of_2(heads // kv_heads)), HEAD_DIM=dim,
        BLOCK_D=block_d, BLOCK_N=32 if interpreting() else 64,  # interpreter: the tests' contexts still cross tiles
        NUM_SPLITS=splits, USE_WINDOW=opts.window is not None, USE_CAP=opts.soft_cap is not None,
        USE_SINKS=opts.sinks is not None, **dot_flags(q.dtype))
    if splits > 1:
        _merge_splits_kernel[(rows, heads)](
            part, lse, sinks, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
            HEAD_DIM=dim, BLOCK_D=block_d, USE_SINKS=opts.sinks is not None)
    return out
