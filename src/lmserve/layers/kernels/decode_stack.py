"""Every decoder layer of a decode-only step in one native call (layers/kernels/csrc/decode_stack.h), as a transform.

`apply_decode_stack(model)` replaces a finished model's `layer_loop` (models/decoder.LayerLoop, the reference) by a
`NativeDecodeLoop` where every layer is one the native stack runs: plain or sandwich layers (Llama, Qwen, Mistral,
SmolLM3, Gemma), QK-norm, any rotary table or none, each layer's scale, window and soft-cap, SwiGLU or GeGLU, every
projection keeping GGUF blocks on the CPU (GGUFLinear, or a FusedGGUFLinear of parts in different layouts), a mixture
of experts in place of the MLP where the moe_kernels transform stacked its experts' GGUF blocks (Qwen3-MoE, Mixtral:
the router, its top-k, the grouped expert GEMMs and the weighted sum in the same call, `MoeWeights`), head
dims 64/128/256, over float32, float16 or quantized (int8 / fp8_e4m3) KV caches (one C++ writer and reader for all
of them, as the module path's). The loop it replaces stays inside it and serves every step the stack cannot: prefill
chunks, and any step whose attention is not the paged cache's decode-only step. A wrapper that can pass through
(LoRA: `passes_through` while no row of the step carries an adapter) is seen through to its base. LoRA wrappers
over CPU slots (float32, float16 or bfloat16: --lora-dtype) also hand the stack their slot tensors (`set_lora`): a decode step whose rows carry adapters
stays in the stack, base rows and adapter rows in one call, each adapter projection adding its rows' deltas through
the kernel the module path calls (csrc/lora_delta.cpp, a fixed order per row). Other wrappers send a step where one
does not pass through to the module loop. (8 rank-16 adapters in a batch of 32, tokens per CPU second against the
base on a loaded 2-core Zen 5, 1 thread: 0.48x with those steps in the module loop, see benchmarks/results/lora.md.) Models with other layers (parallel wrappers, float
or int8/int4 weights, partial rotary: Phi-3.5/4-mini, sinks (gpt-oss), a mixture of experts with a shared expert
(Qwen2-MoE) or without grouped GGUF experts) keep the module loop. The native stack calls the same kernels in the same order, so a step's outputs
are bit-identical either way (tests/test_decode_stack.py, test_model_families.py), except in a mixture of experts, whose
routing and weighted sum the stack computes in plain loops (exp and the sums' order round differently: the same
tokens, logits within float error, tests/test_moe.py); $LMSERVE_DECODE_STACK=0 turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
from torch import nn

from lmserve.layers.attention.context import GroupedAttention
from lmserve.layers.attention.paged import PagedAttention
from lmserve.layers.blocks.mlp import GatedMLP
from lmserve.layers.blocks.moe import SparseMoE
from lmserve.layers.formats.gguf_linear import FusedGGUFLinear, GGUFLinear
from lmserve.layers.formats.linear import PackedLinear
from lmserve.layers.kernels.moe_kernels import NativeExperts, StackedGGUF
from lmserve.layers.kernels.native import LORA_SLOT_DTYPES, native_module

ENV_SWITCH = "LMSERVE_DECODE_STACK"
_ACTS = {"silu": 0, "gelu_tanh": 1}


@dataclass
class MoeWeights:
    """A mixture-of-experts MLP as the stack reads it: the float router and the experts stacked in the packed GGUF
    layout (moe_kernels.StackedGGUF), with blocks/moe.route's options."""

    router: nn.Module  # nn.Linear or PackedLinear, float32
    gate_up: nn.Module  # StackedGGUF
    down: nn.Module
    top_k: int
    renormalize: bool
    softmax_after_topk: bool


@dataclass
class LayerWeights:
    """One decoder layer as the stack needs it: its norms' scales (offset + w), four projections (two with a mixture
    of experts: qkv and o), its attention."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor  # plain layers: the pre-MLP norm; sandwich layers: the post-attention norm
    projections: tuple  # qkv, o, gate_up, down modules (qkv, o where `moe` is set)
    pre_ff_norm: torch.Tensor | None = None  # sandwich layers (Gemma)
    post_ff_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # QK-norm (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    rope: int = 0  # index of its cos/sin table; -1: no rotary
    window: int = 0  # 0: the whole context
    softcap: float = 0.0  # 0: none
    scale: float | None = None  # None: head_dim ** -0.5
    act: str = "silu"
    moe: MoeWeights | None = None  # in place of gate_up and down


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
        self.lora_steps = 0  # of which with adapter rows
        self.lora_batch = None  # the LoRA wrappers' shared LoraBatch once attach_lora gave it their slots

    def attach_lora(self, wrappers: dict[tuple[int, int], nn.Module]) -> bool:
        """Give the stack each (layer, projection 0..3) LoRA wrapper's slot tensors; False (nothing attached) unless
        every one keeps CPU slots the native kernel reads (float32, float16, bfloat16) and they share one batch."""
        batches = {id(w.batch) for w in wrappers.values()}
        if not wrappers or len(batches) != 1 or not hasattr(self.native, "set_lora") or any(
                w.lora_a.dtype not in LORA_SLOT_DTYPES or w.lora_a.device.type != "cpu" for w in wrappers.values()):
            return False
        for (i, j), w in wrappers.items():
            self.native.set_lora(i, j, w.lora_a, [w.lora_b(k) for k in range(len(w.slices))])
        self.lora_batch = next(iter(wrappers.values())).batch
        return True

    @classmethod
    def build(cls, layers: list[LayerWeights], shape: Shape) -> DecodeStack | None:
        """A stack when every projection keeps GGUF blocks on the CPU and the kernels exist, else None."""
        mod = native_module() if os.environ.get(ENV_SWITCH, "1") != "0" else None
        if mod is None or not _fits(layers, shape):
            return None
        tensors, ints, floats = [], [], []
        for lw in layers:
            tensors += [None if t is None else t.detach().contiguous()
                        for t in (lw.in_norm, lw.post_norm, lw.pre_ff_norm, lw.post_ff_norm, lw.q_norm, lw.k_norm)]
            ints += [lw.rope, lw.window, _ACTS[lw.act], lw.moe is not None]
            for proj in lw.projections:
                parts = list(proj.parts) if isinstance(proj, FusedGGUFLinear) else [proj]
                tensors.append(None if proj.bias is None else proj.bias.detach())
                for p in parts:
                    tensors += [p.codes, p.scales, p.mins]
                ints += [len(parts)] + [p.kind for p in parts]
            if lw.moe is not None:
                m = lw.moe
                packed = isinstance(m.router, PackedLinear)  # oneDNN's packed weight and the skinny kernel's panels
                tensors += [m.router.packed if packed else m.router.weight.detach(),
                            m.router.panels if packed else None,
                            None if m.router.bias is None else m.router.bias.detach()]
                ints += [packed, m.router.out_features, m.top_k, m.renormalize, m.softmax_after_topk]
                for experts in (m.gate_up, m.down):
                    tensors += [experts.codes, experts.scales, experts.mins, experts.bias]
                    ints.append(experts.kind)
            # the module path's scale: opts.scale, else head_dim ** -0.5 (layers/paged_attention._scale)
            floats += [lw.scale if lw.scale is not None else shape.head_dim ** -0.5, lw.softcap]
        return cls(mod.DecodeStack(tensors, ints, floats, len(layers), shape.num_heads, shape.num_kv_heads,
                                   shape.head_dim, shape.eps))

    @staticmethod
    def accepts(attn, x: torch.Tensor) -> bool:
        """True for a decode-only step on the paged cache (every row one query token), CPU float32; with several
        KV groups (GroupedAttention), each group's context on the paged cache."""
        contexts = attn.contexts if isinstance(attn, GroupedAttention) else [attn]
        if not all(isinstance(c, PagedAttention) for c in contexts) or x.device.type != "cpu" \
                or x.dtype != torch.float32:
            return False
        m = contexts[0].meta
        return not m.prefills and m.num_decodes == x.shape[0] and m.decode_context_lens is not None

    def __call__(self, x: torch.Tensor, cos: list[torch.Tensor], sin: list[torch.Tensor],
                 attn: PagedAttention | GroupedAttention, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's output, residual stream) after every layer; `x` becomes the residual stream. `lora`: the
        step's LoraMeta when rows carry adapters (attach_lora)."""
        if isinstance(attn, GroupedAttention):  # each layer its group's slots and block tables
            metas = [attn.contexts[g].meta for g in attn.layer_group]
            kv_caches = attn.contexts[0].kv_caches
        else:
            metas, kv_caches = [attn.meta], attn.kv_caches
        self.steps += 1
        args = (x.contiguous(), cos, sin, kv_caches, [m.slot_mapping for m in metas],
                [m.decode_block_tables for m in metas], metas[0].decode_context_lens)
        if lora is None:
            return self.native.forward(*args)
        self.lora_steps += 1
        return self.native.forward(*args, lora.slots, lora.rank)


class NativeDecodeLoop(nn.Module):
    """A model's layer loop with decode-only steps through the native stack; every other step through
    `reference`, the loop it replaced."""

    def __init__(self, stack: DecodeStack, kinds: tuple[str, ...], reference: nn.Module,
                 wrappers: tuple = ()) -> None:
        super().__init__()
        self.stack, self.kinds, self.reference = stack, kinds, reference
        self.wrappers = wrappers  # the pass-through wrappers the stack saw through: a step runs it while all pass

    def forward(self, layers: nn.ModuleList, x: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                attn) -> tuple[torch.Tensor, torch.Tensor]:
        if not DecodeStack.accepts(attn, x):
            return self.reference(layers, x, rope, attn)
        lora = None
        if not all(w.passes_through for w in self.wrappers):
            lora = self.stack.lora_batch.meta if self.stack.lora_batch is not None else None
            if lora is None or lora.slots is None or lora.slots.device.type != "cpu":
                return self.reference(layers, x, rope, attn)
        return self.stack(x, [rope[k][0] for k in self.kinds], [rope[k][1] for k in self.kinds], attn, lora)


def apply_decode_stack(model: nn.Module) -> DecodeStack | None:
    """Run `model`'s decode-only steps through the native stack where it applies (returns it), else leave the
    model as it is (None). Call it on a finished model: after weight formats, LoRA and parallel wrappers."""
    remove_decode_stack(model)
    cfg, kinds = model.config, tuple(model.rotary.kinds)
    if cfg.rotated_dim != cfg.head_dim:  # partial rotary: the native rotary rotates whole heads
        return None
    layers = [layer_weights(layer, kinds) for layer in model.model.layers]
    if any(lw is None for lw in layers):
        return None
    wrappers = tuple(p for lw in layers for p in lw.projections if _passes(p))
    by_place = {(i, j): p for i, lw in enumerate(layers) for j, p in enumerate(lw.projections) if _passes(p)}
    layers = [replace(lw, projections=tuple(p.base if _passes(p) else p for p in lw.projections)) for lw in layers]
    stack = DecodeStack.build(layers, Shape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps))
    if stack is not None:
        if by_place and all(hasattr(p, "lora_a") for p in by_place.values()):
            stack.attach_lora(by_place)
        model.layer_loop = NativeDecodeLoop(stack, kinds, model.layer_loop, wrappers)
    return stack


def remove_decode_stack(model: nn.Module) -> None:
    """Put the reference loop back (benchmarks and tests compare the two)."""
    if isinstance(model.layer_loop, NativeDecodeLoop):
        model.layer_loop = model.layer_loop.reference


def layer_weights(layer: nn.Module, kinds: tuple[str, ...]) -> LayerWeights | None:
    """A decoder layer (models/decoder.py) as the stack reads it, or None where it has something the stack lacks."""
    attn, spec = layer.self_attn, layer.self_attn.spec
    if spec.sinks or spec.opts.sinks is not None:
        return None
    sandwich = hasattr(layer, "pre_feedforward_layernorm")
    moe = _moe_weights(layer.mlp) if isinstance(layer.mlp, SparseMoE) and not sandwich else None
    if moe is None and (not isinstance(layer.mlp, GatedMLP) or layer.mlp.act not in _ACTS):
        return None  # a mixture of experts without grouped GGUF experts, or a wrapped MLP
    act = layer.mlp.experts[0].act if moe is not None else layer.mlp.act
    qk = spec.qk_norm_eps is not None
    projections = (attn.qkv_proj, attn.o_proj) if moe is not None else _projections(layer)
    return LayerWeights(
        layer.input_layernorm.scale(), layer.post_attention_layernorm.scale(), projections,
        layer.pre_feedforward_layernorm.scale() if sandwich else None,
        layer.post_feedforward_layernorm.scale() if sandwich else None,
        attn.q_norm.scale() if qk else None, attn.k_norm.scale() if qk else None,
        kinds.index(spec.rope) if spec.rope is not None else -1, spec.opts.window or 0, spec.opts.soft_cap or 0.0,
        spec.opts.scale, act, moe)


def _moe_weights(mlp: SparseMoE) -> MoeWeights | None:
    """The stack's view of a mixture of experts whose experts the moe_kernels transform stacked as packed GGUF blocks
    (NativeExperts over StackedGGUF), with a float32 router (nn.Linear or PackedLinear), no shared expert (Qwen2-MoE) and an activation the
    stack has (not gpt-oss's clamped SwiGLU); else None."""
    grouped, router = mlp.grouped, mlp.gate
    if not isinstance(grouped, NativeExperts) or not isinstance(grouped.gate_up, StackedGGUF) or \
            not isinstance(grouped.down, StackedGGUF) or mlp.shared_expert is not None:
        return None
    weight = router.packed if type(router) is PackedLinear else router.weight if type(router) is nn.Linear else None
    if weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    if mlp.experts[0].act not in _ACTS or grouped.gate_up.codes.shape[1] * 16 != 2 * mlp.experts[0].down_proj.in_features:
        return None
    return MoeWeights(router, grouped.gate_up, grouped.down, mlp.top_k, mlp.renormalize, mlp.softmax_after_topk)


def _projections(layer: nn.Module) -> tuple:
    """A decoder layer's qkv, o, gate_up and down modules, as the model holds them (wrappers included)."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _passes(proj: nn.Module) -> bool:
    """A wrapper that can step aside for its base (LoRA's LoraLinear): the stack runs the base while it does."""
    return hasattr(proj, "passes_through") and hasattr(proj, "base")


def _gguf(proj: nn.Module) -> bool:
    """Exactly GGUF block layers (no LoRA or parallel wrappers)."""
    if type(proj) is FusedGGUFLinear:
        return all(type(p) is GGUFLinear for p in proj.parts)
    return type(proj) is GGUFLinear


def _fits(layers: list[LayerWeights], shape: Shape) -> bool:
    """GGUF projections, float32 CPU norms, a head layout the attention kernel has."""
    if shape.head_dim not in (64, 128, 256) or shape.num_heads % shape.num_kv_heads or \
            shape.num_heads // shape.num_kv_heads > 16:
        return False
    for lw in layers:
        if not all(_gguf(p) for p in lw.projections):
            return False
        norms = [t for t in (lw.in_norm, lw.post_norm, lw.pre_ff_norm, lw.post_ff_norm, lw.q_norm, lw.k_norm)
                 if t is not None]
        if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in norms):
            return False
    return True
