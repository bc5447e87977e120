"""Self-attention of one decoder layer: fused QKV projection, optional QK-norm, rotary (whole, partial or
none), attention through the context with the layer's options (and learned sinks), output projection."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from lmserve.layers.attention.context import DEFAULT, AttentionContext, AttnOptions
from lmserve.layers.blocks.norm import RMSNorm
from lmserve.layers.kernels.fused import rotary


@dataclass(frozen=True)
class AttentionSpec:
    """The shape and options of one layer's attention."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm_eps: float | None = None  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3); None: none
    norm_offset: float = 0.0  # the QK-norms' (offset + w), as the model's other norms
    rope: str | None = "full"  # the rotary table it reads ("full", "sliding"); None: no rotary (NoPE)
    opts: AttnOptions = DEFAULT  # scale, window, soft-cap
    sinks: bool = False  # a learned sink logit per query head (gpt-oss): the `sinks` parameter, passed in the options


class SelfAttention(nn.Module):
    """q/k/v from one matrix, rotated by the layer's table, attended by the context, projected back."""

    def __init__(self, spec: AttentionSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.spec = layer_idx, spec
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm_eps is not None:
            self.q_norm = RMSNorm(spec.head_dim, spec.qk_norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(spec.head_dim, spec.qk_norm_eps, spec.norm_offset)
        # [num_heads]: filled by the loader, read by every attention path through AttnOptions.sinks
        self.sinks = nn.Parameter(torch.empty(spec.num_heads)) if spec.sinks else None

    def forward(self, x: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                attn: AttentionContext) -> torch.Tensor:
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        cos_sin = rope[self.spec.rope] if self.spec.rope is not None else None
        if self.spec.qk_norm_eps is None:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            # q and k rotate together: one set of elementwise ops per layer instead of two
            qk = qk.view(-1, h + kvh, d)
            if cos_sin is not None:
                qk = rotary(qk, *cos_sin)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = self.q_norm(q.reshape(-1, h, d))[0], self.k_norm(k.reshape(-1, kvh, d))[0]  # [T, heads, D]
            if cos_sin is not None:
                q, k = rotary(q, *cos_sin), rotary(k, *cos_sin)
        v = v.view(-1, kvh, d)
        return self.o_proj(attn.attend(self.layer_idx, q, k, v, self.options()))

    def options(self) -> AttnOptions:
        """This layer's attention options, with its sink logits where it has them (the parameter as it is now: a
        loader or device move may have replaced its storage since the layer was built), in float32 as every backend
        reads them (a no-op for a float32 model)."""
        return self.spec.opts if self.sinks is None else replace(self.spec.opts, sinks=self.sinks.float())
