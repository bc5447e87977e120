"""The attention seam: the model hands q/k/v to an `AttentionContext`, which owns where K/V live.

`ContiguousAttention` attends within each sequence of the flat batch with no cache (model tests,
one-shot scoring). The engine's paged KV cache implements the same protocol in `paged_attention.py`.
Each layer passes its `AttnOptions` (softmax scale, sliding window, logit soft-cap, sinks); every
backend honours all of them, and `attention_ref` is the plain definition they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True, eq=False)
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

    @property
    def plain(self) -> bool:
        """True when only the scale differs from plain causal attention (SDPA's fast paths apply)."""
        return self.window is None and self.soft_cap is None and self.sinks is None


DEFAULT = AttnOptions()


class AttentionContext(Protocol):
    """What a model layer calls to attend; one object per forward pass, shared by all layers. A context may also offer
    `cuts()` (row offsets between whole sequences) and `rows(lo, hi)` (the context of those rows alone):
    pipeline micro-batches (layers/formats/pipeline.py) cut a step only where its context does."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               opts: AttnOptions = DEFAULT) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]."""
        ...


def visible(num_queries: int, num_keys: int, window: int | None, device: torch.device | None = None) -> torch.Tensor:
    """[Tq, Tk] bool: the queries are the last Tq of Tk positions; key j is seen by query i's position p
    when j <= p and, with a window, j > p - window (HF's sliding-window mask and llama.cpp's agree)."""
    pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    keys = torch.arange(num_keys, device=device)[None, :]
    mask = keys <= pos
    return mask if window is None else mask & (keys > pos - window)


def within_spans(spans: Sequence[tuple[int, int]], num_queries: int, num_keys: int,
                 device: torch.device | None = None) -> torch.Tensor:
    """[Tq, Tk] bool: query and key lie in the same [a, b) span (the queries are the last Tq of Tk positions). An
    image's tokens see each other both ways (Gemma 3) where this is ORed into the causal mask."""
    qpos = torch.arange(num_keys - num_queries, num_keys, device=device)
    keys = torch.arange(num_keys, device=device)
    out = torch.zeros(num_queries, num_keys, dtype=torch.bool, device=device)
    for a, b in spans:
        out |= ((qpos >= a) & (qpos < b))[:, None] & ((keys >= a) & (keys < b))[None, :]
    return out


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  opts: AttnOptions = DEFAULT) -> torch.Tensor:
    """The plain definition, in float32: q [..., Tq, H, D], k/v [..., Tk, Hkv, D], mask [..., Tq, Tk] (True = may
    attend; rows may be all False only where sinks absorb them) -> [..., Tq, H * D] in q's dtype."""
    heads, kv_heads, d = q.shape[-2], k.shape[-2], q.shape[-1]
    qf, kf, vf = q.float(), k.float(), v.float()
    if heads != kv_heads:  # query head h reads kv head h // (H / Hkv), as HF's repeat_kv
        kf, vf = kf.repeat_interleave(heads // kv_heads, dim=-2), vf.repeat_interleave(heads // kv_heads, dim=-2)
    scale = opts.scale if opts.scale is not None else d ** -0.5
    scores = torch.einsum("...qhd,...khd->...hqk", qf, kf) * scale  # [..., H, Tq, Tk]
    if opts.soft_cap is not None:
        scores = torch.tanh(scores / opts.soft_cap) * opts.soft_cap
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    if opts.sinks is not None:  # one extra column per head, dropped after the softmax
        sink = opts.sinks.float().view(heads, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    out = torch.einsum("...hqk,...khd->...qhd", probs, vf)
    return out.reshape(*q.shape[:-2], heads * d).to(q.dtype)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                opts: AttnOptions = DEFAULT, spans: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
    """Attention for one sequence: q [Tq, H, D] (the last Tq positions), k/v [Tk, Hkv, D] -> [Tq, H * D].

    Without a mask, Tq == Tk and attention is plainly causal; with one, `mask` [Tq, Tk] (bool, True = may
    attend) places the queries after a cached prefix. A window or soft-cap builds its own mask from the shapes.
    `spans` (positions [a, b), e.g. an image's tokens) are attended bidirectionally within themselves: the span
    must lie whole inside the keys (the scheduler never ends a chunk inside one).
    """
    if spans:  # (causal OR same span) AND window, as transformers' Gemma 3 composes them
        mask = visible(q.shape[0], k.shape[0], None, q.device) | within_spans(spans, q.shape[0], k.shape[0], q.device)
        if opts.window is not None:
            qpos = torch.arange(k.shape[0] - q.shape[0], k.shape[0], device=q.device)[:, None]
            mask = mask & (torch.arange(k.shape[0], device=q.device)[None, :] > qpos - opts.window)
    elif not opts.plain:
        mask = visible(q.shape[0], k.shape[0], opts.window, q.device)
        if opts.soft_cap is not None or opts.sinks is not None:  # SDPA has neither
            return attention_ref(q, k, v, mask, opts)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1], scale=opts.scale,
    )  # [H, Tq, D]
    return out.transpose(0, 1).reshape(q.shape[0], -1)


@dataclass
class ContiguousAttention:
    """No KV cache: each sequence attends causally over its own tokens in this batch (and, where `spans` gives a
    sequence's [a, b) spans, bidirectionally within each: Gemma 3's images)."""

    seq_lens: Sequence[int]
    spans: Sequence[Sequence[tuple[int, int]]] | None = None

    def cuts(self) -> list[int]:
        """Row offsets between sequences (where `rows` may cut)."""
        return [0, *accumulate(self.seq_lens)]

    def rows(self, lo: int, hi: int) -> ContiguousAttention:
        """The sequences in rows [lo, hi) (both offsets from `cuts`)."""
        starts = self.cuts()
        a, b = starts.index(lo), starts.index(hi)
        return ContiguousAttention(self.seq_lens[a:b], self.spans[a:b] if self.spans else None)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               opts: AttnOptions = DEFAULT) -> torch.Tensor:
        outs, start = [], 0
        for i, n in enumerate(self.seq_lens):
            spans = self.spans[i] if self.spans else ()
            outs.append(causal_sdpa(q[start:start + n], k[start:start + n], v[start:start + n], opts=opts,
                                    spans=spans))
            start += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]


@dataclass
class GroupedAttention:
    """Layers in several KV cache groups (cache/kv_groups.py): each layer attends through its group's context,
    which holds that group's block tables and slots."""

    contexts: Sequence[AttentionContext]
    layer_group: Sequence[int]  # [num_layers] the group of each layer

    def cuts(self) -> list[int]:
        """Where every group's context may cut (the groups share the step's rows and their order)."""
        return sorted(set.intersection(*(set(c.cuts()) for c in self.contexts)))

    def rows(self, lo: int, hi: int) -> GroupedAttention:
        """Each group's attention for rows [lo, hi) alone."""
        return replace(self, contexts=[c.rows(lo, hi) for c in self.contexts])

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               opts: AttnOptions = DEFAULT) -> torch.Tensor:
        return self.contexts[self.layer_group[layer_idx]].attend(layer_idx, q, k, v, opts)
