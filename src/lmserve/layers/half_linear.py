"""An unquantized LM head and token table held in their checkpoint's half dtype (bfloat16 / float16), float32 math.

GPTQ, AWQ and llm-compressor leave the LM head unquantized, stored in the model's own half dtype. Widened to
float32 it is the largest weight a decode step reads (SmolLM2-135M: 49152 x 576, 113 MB against ~50 MB for all
its 4-bit layers). `HalfLinear` keeps it as the checkpoint stores it, in the skinny kernel's panels
(layers/csrc/gemv.cpp widens each weight exactly as it reads it, float32 activations and sums): lossless against
the checkpoint, half the bytes. Every row count runs that one kernel (a whole prefill's rows too), so a row's
logits never depend on its batch; they are bit for bit the float32 skinny kernel's over the upcast weights.
`HalfEmbedding` looks rows up in the same panels where the head is tied (the table held once) or in its own rows.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lmserve.layers.linear import PANEL, to_panels
from lmserve.layers.native import native_module

HALF_DTYPES = (torch.bfloat16, torch.float16)


def panel_rows(panels: torch.Tensor, n: int) -> torch.Tensor:
    """[N/16, K, 16] panels -> the first n rows [n, K] of the matrix they hold (a copy, in their dtype)."""
    p, k, _ = panels.shape
    return panels.transpose(1, 2).reshape(p * PANEL, k)[:n]


def reference_half_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The plain path: the weights widened to float32 whole, one matmul (no native kernels; the parity tests)."""
    return F.linear(x, panel_rows(panels, n).float(), bias)


class HalfLinear(nn.Module):
    """y = x W^T (+ b): x float32, W [N, K] bfloat16 or float16 in skinny-kernel panels, float32 out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dtype not in HALF_DTYPES or weight.dim() != 2:
            raise ValueError(f"HalfLinear: expected a bfloat16 or float16 [N, K] weight, got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("half_panels", to_panels(weight))  # [N/16, K, 16]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [T, K]
        mod = native_module()  # None when the kernels are off (or switched off after load: tests)
        if mod is None or rows.dtype != torch.float32 or rows.device.type != "cpu":
            y = reference_half_linear(rows.float(), self.half_panels, self.out_features, self.bias)
        else:
            y = mod.skinny_linear(rows, self.half_panels, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.half_panels.dtype}"


class HalfEmbedding(nn.Module):
    """Token ids -> float32 rows of a bfloat16 / float16 table: its own [N, K] rows, or a tied head's panels."""

    def __init__(self, num_embeddings: int, table: torch.Tensor) -> None:
        """`table`: rows [N, K], or panels [N/16, K, 16] shared with a tied HalfLinear (no second copy)."""
        super().__init__()
        if table.dtype not in HALF_DTYPES:
            raise ValueError(f"HalfEmbedding: expected a bfloat16 or float16 table, got {table.dtype}")
        self.num_embeddings, self.embedding_dim = num_embeddings, table.shape[1]
        self.in_panels = table.dim() == 3
        self.register_buffer("table", table)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = self.table[ids // PANEL, :, ids % PANEL] if self.in_panels else self.table[ids]  # [T, K]
        return rows.float().view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        where = "the tied head's panels" if self.in_panels else "rows"
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.table.dtype}, in {where}"


def tied_half(weight: torch.Tensor) -> tuple[HalfEmbedding, HalfLinear]:
    """A tied table [N, K] held once: the head's panels, which the embedding looks its rows up in."""
    head = HalfLinear(weight)
    return HalfEmbedding(weight.shape[0], head.half_panels), head
