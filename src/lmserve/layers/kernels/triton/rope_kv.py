"""Rotary embedding of q and k fused with the store of the new K/V into the paged cache.

One program per token: it rotates the token's query heads (written to `q_out`, which may be q itself) and
its key heads, and stores the rotated key and the value at the token's slot, so k is read once and never
written back to memory unrotated. Hugging Face's non-interleaved layout: the first rotary_dim dims of a head
are two halves rotated against each other; dims past rotary_dim (partial rotary, Phi-3) pass through.
A negative slot (a padding token) stores nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(X, row, stride_h, heads, c, s, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """(x1 * cos - x2 * sin, x2 * cos + x1 * sin) for every head of one token's row, in float32."""
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    ok = (h < heads)[:, None] & (j < HALF)[None, :]
    base = X + row + h[:, None] * stride_h + j[None, :]
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=ok, other=0.0).to(tl.float32)
    return x1 * c[None, :] - x2 * s[None, :], x2 * c[None, :] + x1 * s[None, :], ok


@triton.jit
def _rope_write_kernel(
        Q, K, V, Cos, Sin, QOut, KCache, VCache, SlotMapping,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_ot, stride_oh,
        stride_kb, stride_kp, stride_kch, stride_vb, stride_vp, stride_vch, page_size,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
        PASS: tl.constexpr):
    t = tl.program_id(0)
    j = tl.arange(0, BLOCK_HALF)
    c = tl.load(Cos + t * stride_ct + j, mask=j < HALF, other=0.0).to(tl.float32)  # the halves of cos are equal
    s = tl.load(Sin + t * stride_ct + j, mask=j < HALF, other=0.0).to(tl.float32)
    hq = tl.arange(0, BLOCK_H)
    q1, q2, q_ok = _rotate(Q, t * stride_qt, stride_qh, NUM_HEADS, c, s, HALF, BLOCK_H, BLOCK_HALF)
    q_dst = QOut + t * stride_ot + hq[:, None] * stride_oh + j[None, :]
    tl.store(q_dst, q1.to(QOut.dtype.element_ty), mask=q_ok)
    tl.store(q_dst + HALF, q2.to(QOut.dtype.element_ty), mask=q_ok)

    slot = tl.load(SlotMapping + t).to(tl.int64)
    if slot >= 0:
        block, offset = slot // page_size, slot % page_size
        hk = tl.arange(0, BLOCK_KV)
        k1, k2, k_ok = _rotate(K, t * stride_kt, stride_kh, NUM_KV_HEADS, c, s, HALF, BLOCK_KV, BLOCK_HALF)
        k_dst = KCache + block * stride_kb + offset * stride_kp + hk[:, None] * stride_kch + j[None, :]
        tl.store(k_dst, k1.to(KCache.dtype.element_ty), mask=k_ok)
        tl.store(k_dst + HALF, k2.to(KCache.dtype.element_ty), mask=k_ok)
        d = tl.arange(0, BLOCK_D)
        kv_ok = (hk < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        v = tl.load(V + t * stride_vt + hk[:, None] * stride_vh + d[None, :], mask=kv_ok)
        tl.store(VCache + block * stride_vb + offset * stride_vp + hk[:, None] * stride_vch + d[None, :],
                 v.to(VCache.dtype.element_ty), mask=kv_ok)
        if PASS:  # dims past rotary_dim: copied as they are
            p_ok = kv_ok & (d >= 2 * HALF)[None, :]
            kp = tl.load(K + t * stride_kt + hk[:, None] * stride_kh + d[None, :], mask=p_ok)
            tl.store(KCache + block * stride_kb + offset * stride_kp + hk[:, None] * stride_kch + d[None, :],
                     kp.to(KCache.dtype.element_ty), mask=p_ok)
    if PASS:
        d = tl.arange(0, BLOCK_D)
        p_ok = (hq < NUM_HEADS)[:, None] & (d >= 2 * HALF)[None, :] & (d < HEAD_DIM)[None, :]
        qp = tl.load(Q + t * stride_qt + hq[:, None] * stride_qh + d[None, :], mask=p_ok)
        tl.store(QOut + t * stride_ot + hq[:, None] * stride_oh + d[None, :], qp.to(QOut.dtype.element_ty), mask=p_ok)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q [T, H, D] and k [T, Hkv, D] by cos/sin [T, rotary_dim] (Hugging Face's layout: both halves equal),
    store rotated k and v at slot_mapping [T] of k/v_cache [num_blocks, block_size, Hkv, D]; returns rotated q
    (in `q_out`, which may be q: each program reads its token's q before writing it)."""
    tokens, heads, dim = q.shape
    kv_heads, rot = k.shape[1], cos.shape[-1]
    assert rot % 2 == 0 and rot <= dim and cos.stride(-1) == 1 and sin.stride() == cos.stride()
    assert q.stride(2) == k.stride(2) == v.stride(2) == k_cache.stride(3) == v_cache.stride(3) == 1
    q_out = torch.empty_like(q) if q_out is None else q_out
    if tokens == 0:
        return q_out
    _rope_write_kernel[(tokens,)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_cache.shape[1],
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=dim, HALF=rot // 2,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_KV=triton.next_power_of_2(kv_heads),
        BLOCK_HALF=triton.next_power_of_2(rot // 2), BLOCK_D=triton.next_power_of_2(dim), PASS=rot < dim)
    return q_out
