"""Prefill / extend attention over block tables: each sequence's new queries after its cached prefix.

The chunk's own K/V are written into the cache first (as every step does), so one loop covers a whole
prompt, a chunk of a chunked prefill and the tokens after a prefix-cache hit alike: query i of sequence r
sits at position seq_lens[r] - q_len + i and sees the keys up to it (and within the window). One program per
(sequence, query head, tile of BLOCK_M queries) walks only the key tiles its queries can see: from the window
start of its first query to its last query's position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmserve.layers.attention.context import AttnOptions
from lmserve.layers.kernels.triton import dot_flags, interpreting
from lmserve.layers.kernels.triton.decode import attend_tile, kv_strides, kv_tile


@triton.jit
def _prefill_kernel(
        Q, K, V, Out, BlockTables, QueryStartLoc, SeqLens, Sinks,
        stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_tn,
        stride_ot, stride_oh,
        scale, soft_cap, window, page_size,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr, USE_SINKS: tl.constexpr,
        UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    seq, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(QueryStartLoc + seq).to(tl.int32)
    q_len = tl.load(QueryStartLoc + seq + 1).to(tl.int32) - q_start
    if tile * BLOCK_M >= q_len:  # the grid is sized for the longest chunk of the step
        return
    seq_len = tl.load(SeqLens + seq).to(tl.int32)
    prefix = seq_len - q_len
    kv_head = head // GROUP

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    i_ok, d_ok = i < q_len, d < HEAD_DIM
    pos = prefix + i  # [BLOCK_M] each query's position
    q = tl.load(Q + (q_start + i)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=i_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    last = tl.minimum(prefix + (tile + 1) * BLOCK_M, seq_len)  # one past the tile's last query position
    first = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0) if USE_WINDOW else 0
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(first, last, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < last
        k, v = kv_tile(K + kv_head * stride_kh, V + kv_head * stride_kh, BlockTables + seq * stride_tb, t, t_ok, d,
                       d_ok, page_size, stride_tn, stride_kb, stride_kt, UPCAST)  # [BLOCK_N, BLOCK_D]
        visible = t_ok[None, :] & (t[None, :] <= pos[:, None])  # [BLOCK_M, BLOCK_N]: causal
        if USE_WINDOW:
            visible = visible & (t[None, :] > pos[:, None] - window)
        m, l, acc = attend_tile(q, k, v, visible, m, l, acc, scale, soft_cap, USE_CAP, PRECISION)
    if USE_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32)
        m_safe = tl.where(m == float("-inf"), sink, tl.maximum(m, sink))
        scale_acc = tl.exp(m - m_safe)
        acc = acc * scale_acc[:, None]
        l = l * scale_acc + tl.exp(sink - m_safe)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(Out + (q_start + i)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=i_ok[:, None] & d_ok[None, :])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                  opts: AttnOptions | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D]: sequence r's new queries are rows query_start_loc[r]:query_start_loc[r+1], the last tokens of
    its seq_lens[r]; its keys (already in k/v_cache [num_blocks, block_size, Hkv, D]) through block_tables[r].
    `max_query_len` (a host int: the longest chunk) sizes the grid. Returns [T, H, D] in q's dtype."""
    opts = opts or AttnOptions()
    heads, dim = q.shape[1], q.shape[2]
    assert q.stride(2) == 1, "head_dim must be contiguous"
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return out
    # under the interpreter (tests at small shapes) tiles of 16 so that short prompts still cross tile edges
    block = 16 if interpreting() else 64
    sinks = opts.sinks if opts.sinks is not None else seq_lens  # any tensor: not read without USE_SINKS
    grid = (num_seqs, heads, triton.cdiv(max_query_len, block))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, sinks,
        q.stride(0), q.stride(1), *kv_strides(k_cache, v_cache), block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1),
        opts.scale if opts.scale is not None else dim ** -0.5, opts.soft_cap or 1.0, opts.window or 0,
        k_cache.shape[1],
        GROUP=heads // k_cache.shape[2], HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_M=block, BLOCK_N=block, USE_WINDOW=opts.window is not None,
        USE_CAP=opts.soft_cap is not None, USE_SINKS=opts.sinks is not None, **dot_flags(q.dtype))
    return out
