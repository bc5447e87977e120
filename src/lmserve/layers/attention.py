"""The attention seam: the model hands q/k/v to an `AttentionContext`, which owns where K/V live.

`ContiguousAttention` attends within each sequence of the flat batch with no cache (model tests,
one-shot scoring). The engine's paged KV cache implements the same protocol in `paged_attention.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttnOptions:
    """How one layer attends, beyond plain causal softmax attention; one object per layer, built once.

    Every attention backend takes the same object, so a model states its options once (Gemma 2's soft-cap and
    sliding window, gpt-oss's sinks) and each backend either honours all of them or refuses the model.
    """

    scale: float | None = None  # logits = q.k * scale; None: head_dim ** -0.5
    # sliding window in tokens, as Hugging Face counts it: a query at position p sees keys p - window < j <= p
    window: int | None = None
    soft_cap: float | None = None  # logits -> soft_cap * tanh(logits / soft_cap) (Gemma 2), after the scale
    # per query head, a learned logit that joins the softmax's denominator and carries no value (gpt-oss);
    # [num_heads] float32, on the model's device
    sinks: torch.Tensor | None = None


class AttentionContext(Protocol):
    """What a model layer calls to attend; one object per forward pass, shared by all layers."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]."""
        ...


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for one sequence: q [Tq, H, D], k/v [Tk, Hkv, D] -> [Tq, H * D].

    Without a mask, Tq == Tk and attention is plainly causal; with one, `mask` [Tq, Tk] (bool,
    True = may attend) places the queries after a cached prefix.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1],
    )  # [H, Tq, D]
    return out.transpose(0, 1).reshape(q.shape[0], -1)


@dataclass
class ContiguousAttention:
    """No KV cache: each sequence attends causally over its own tokens in this batch."""

    seq_lens: Sequence[int]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for n in self.seq_lens:
            outs.append(causal_sdpa(q[start:start + n], k[start:start + n], v[start:start + n]))
            start += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]
