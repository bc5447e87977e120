"""Every decoder layer of a decode-only step in one native call (layers/csrc/decode_stack.cpp), as a transform.

`apply_decode_stack(model)` replaces a finished model's `layer_loop` (models/decoder.LayerLoop, the reference)
by a `NativeDecodeLoop` where every layer is one the native stack runs: plain pre-norm layers (SwiGLU,
whole-head rotary from one table, plain causal attention) whose projections all keep GGUF blocks on the CPU.
The loop it replaces stays inside it and serves every step the stack cannot: prefill chunks, and any step
whose attention is not the paged cache's decode-only step. Models with other layers (LoRA wrappers, float
or int8/int4 weights, sandwich norms, QK-norm, GeGLU, windows, soft-caps, NoPE: Gemma, Qwen3, Mistral's
window, SmolLM3, Phi-3's partial rotary) keep the module loop. The native stack calls the same kernels in
the same order, so a step's outputs are bit-identical either way (tests/test_decode_stack.py);
$LMSERVE_DECODE_STACK=0 turns it off (benchmarks compare the two).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

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


class NativeDecodeLoop(nn.Module):
    """A model's layer loop with decode-only steps through the native stack; every other step through
    `reference`, the loop it replaced."""

    def __init__(self, stack: DecodeStack, reference: nn.Module) -> None:
        super().__init__()
        self.stack, self.reference = stack, reference

    def forward(self, layers: nn.ModuleList, x: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                attn) -> tuple[torch.Tensor, torch.Tensor]:
        if not DecodeStack.accepts(attn, x):
            return self.reference(layers, x, rope, attn)
        return self.stack(x, *rope["full"], attn)


def apply_decode_stack(model: nn.Module) -> DecodeStack | None:
    """Run `model`'s decode-only steps through the native stack where it applies (returns it), else leave the
    model as it is (None). Call it on a finished model: after weight formats, LoRA and parallel wrappers."""
    remove_decode_stack(model)
    cfg = model.config
    if cfg.rotated_dim != cfg.head_dim or not all(_plain_layer(layer) for layer in model.model.layers):
        return None
    layers = [LayerWeights(l.input_layernorm.weight, l.post_attention_layernorm.weight,
                           (l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj, l.mlp.down_proj))
              for l in model.model.layers]
    stack = DecodeStack.build(layers, Shape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps))
    if stack is not None:
        model.layer_loop = NativeDecodeLoop(stack, model.layer_loop)
    return stack


def remove_decode_stack(model: nn.Module) -> None:
    """Put the reference loop back (benchmarks and tests compare the two)."""
    if isinstance(model.layer_loop, NativeDecodeLoop):
        model.layer_loop = model.layer_loop.reference


def _plain_layer(layer: nn.Module) -> bool:
    """A layer exactly as the native stack computes it: pre-norm (weights as they are), SwiGLU, whole-head rotary
    from the "full" table, no QK-norm, plain causal attention with the default scale."""
    spec = layer.self_attn.spec
    plain_norms = not hasattr(layer, "pre_feedforward_layernorm") and \
        layer.input_layernorm.offset == 0 and layer.post_attention_layernorm.offset == 0
    return plain_norms and layer.mlp.act == "silu" and spec.qk_norm_eps is None and spec.rope == "full" \
        and spec.opts.plain and spec.opts.scale is None


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
