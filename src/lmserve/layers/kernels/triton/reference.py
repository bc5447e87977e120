"""Plain torch references for the Triton kernels: one sequence at a time, float32, every option spelled out.

They are written for reading, not speed: the kernels' tests compare against them, and they define what
each option means (the same semantics as Hugging Face's eager attention).
"""

from __future__ import annotations

import torch

from lmserve.layers.attention.context import AttnOptions
from lmserve.layers.blocks.rotary import apply_rotary


def gather_keys(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """One sequence's first `num_tokens` cached rows [num_tokens, kv_heads, head_dim] from cache [NB, PS, Hkv, D]."""
    page = cache.shape[1]
    pos = torch.arange(num_tokens, device=cache.device)
    return cache[block_table[pos // page].long(), pos % page]


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        opts: AttnOptions | None = None) -> torch.Tensor:
    """Attention of each sequence's new queries over its cached keys.

    q [T, H, D]: sequence r's queries are rows query_start_loc[r]:query_start_loc[r+1], the last of its
    seq_lens[r] tokens (so a decode row is a sequence of one query). Returns [T, H, D] in q's dtype.
    """
    opts = opts or AttnOptions()
    out = torch.empty_like(q)
    heads, dim = q.shape[1], q.shape[2]
    scale = opts.scale if opts.scale is not None else dim ** -0.5
    for r in range(len(seq_lens)):
        a, b, n = int(query_start_loc[r]), int(query_start_loc[r + 1]), int(seq_lens[r])
        k = gather_keys(k_cache, block_tables[r], n).float()  # [n, Hkv, D]
        v = gather_keys(v_cache, block_tables[r], n).float()
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [n, H, D]
        logits = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale  # [H, q, n]
        if opts.soft_cap is not None:
            logits = opts.soft_cap * torch.tanh(logits / opts.soft_cap)
        qpos = torch.arange(n - (b - a), n, device=q.device)[:, None]
        kpos = torch.arange(n, device=q.device)[None, :]
        visible = kpos <= qpos
        if opts.window is not None:
            visible &= kpos > qpos - opts.window
        logits = logits.masked_fill(~visible, float("-inf"))
        if opts.sinks is not None:  # one more column per head that takes probability but carries no value
            sink = opts.sinks.float()[:, None, None].expand(heads, b - a, 1)
            probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = logits.softmax(dim=-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, opts: AttnOptions | None = None) -> torch.Tensor:
    """One query row per sequence: q [B, H, D] attending over its first context_lens[b] keys -> [B, H, D]."""
    starts = torch.arange(q.shape[0] + 1, device=q.device)
    return attention_reference(q, k_cache, v_cache, block_tables, starts, context_lens, opts)


def rope_write_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotate q and k (the first cos.shape[-1] dims of each head; the rest pass through), store k and v at
    their slots (a negative slot is not stored); returns the rotated q. cos/sin [T, rotary_dim]."""
    rot = cos.shape[-1]
    c, s = cos[:, None, :].float(), sin[:, None, :].float()
    q_rot, k_rot = q.float().clone(), k.float().clone()
    q_rot[..., :rot] = apply_rotary(q_rot[..., :rot], c, s)
    k_rot[..., :rot] = apply_rotary(k_rot[..., :rot], c, s)
    keep = slot_mapping >= 0
    page = k_cache.shape[1]
    blocks, offsets = slot_mapping[keep] // page, slot_mapping[keep] % page
    k_cache[blocks, offsets] = k_rot[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)
    return q_rot.to(q.dtype)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """Mixture of experts with SwiGLU experts, expert by expert.

    x [T, hidden]; w13 [E, 2 * inter, hidden] (gate rows, then up rows); w2 [E, hidden, inter];
    topk_ids / topk_weights [T, k]: each token's experts and their router weights. Returns [T, hidden].
    """
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if len(tok) == 0:
            continue
        h = x[tok].float() @ w13[e].float().t()  # [n, 2 * inter]
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y = h @ w2[e].float().t()  # [n, hidden]
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)
