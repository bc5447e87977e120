"""Every decoder layer of a decode-only step in one native call (layers/csrc/decode_stack.cpp).

The model's PyTorch modules stay the reference path and serve every step this cannot: prefill chunks,
LoRA wrappers, float or int8/int4 weights, devices other than the CPU. The native stack calls the same
kernels in the same order, so a step's outputs are bit-identical either way (tests/test_decode_stack.py);
$LMSERVE_DECODE_STACK=0 turns it off (benchmarks compare the two).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lmserve.layers.gguf_linear import GGUFLinear
from lmserve.layers.native import native_module
from lmserve.layers.paged_attention import PagedAttention

ENV_SWITCH = "LMSERVE_DECODE_STACK"


@dataclass
class LayerWeights:
    """One decoder layer as the stack needs it: two norm weights and four projections."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    projections: tuple  # qkv, o, gate_up, down modules


@dataclass
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


class DecodeStack:
    """The native stack over a model's layers; `build` says None where it does not apply."""

    def __init__(self, native) -> None:
        self.native = native
        self.steps = 0  # decode steps run through it (tests check that it really ran)

    @classmethod
    def build(cls, layers: list[LayerWeights], shape: Shape) -> DecodeStack | None:
        """A stack when every projection keeps GGUF blocks on the CPU and the kernels exist, else None."""
        mod = native_module() if os.environ.get(ENV_SWITCH, "1") != "0" else None
        if mod is None or not _fits(layers, shape):
            return None
        tensors, kinds = [], []
        for lw in layers:
            tensors += [lw.in_norm.detach().contiguous(), lw.post_norm.detach().contiguous()]
            for p in lw.projections:
                tensors += [p.codes, p.scales, p.mins, None if p.bias is None else p.bias.detach()]
                kinds.append(p.kind)
        return cls(mod.DecodeStack(tensors, kinds, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.eps))

    @staticmethod
    def accepts(attn, x: torch.Tensor) -> bool:
        """True for a decode-only step on the paged cache (every row one query token), CPU float32."""
        if not isinstance(attn, PagedAttention) or x.device.type != "cpu" or x.dtype != torch.float32:
            return False
        m = attn.meta
        return not m.prefills and m.num_decodes == x.shape[0] and m.decode_context_lens is not None

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attn: PagedAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """(last MLP output, residual stream) after every layer; `x` becomes the residual stream."""
        m = attn.meta
        self.steps += 1
        return self.native.forward(x.contiguous(), cos, sin, attn.kv_caches, m.slot_mapping,
                                   m.decode_block_tables, m.decode_context_lens)


def _fits(layers: list[LayerWeights], shape: Shape) -> bool:
    """Exactly GGUFLinear projections (no LoRA or parallel wrappers), float32 CPU norms, a kernel head layout."""
    if shape.head_dim not in (64, 128) or shape.num_heads % shape.num_kv_heads or \
            shape.num_heads // shape.num_kv_heads > 16:
        return False
    for lw in layers:
        if any(type(p) is not GGUFLinear for p in lw.projections):
            return False
        if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in (lw.in_norm, lw.post_norm)):
            return False
    return True
