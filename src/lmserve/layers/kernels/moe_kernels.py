"""Fast expert paths for the mixture-of-experts layer, applied to a finished model as a transform.

`apply_moe_kernels(model, triton)` fills each `SparseMoE.grouped` seam (layers/blocks/moe.py) with one of:
- `NativeExperts` (CPU): every expert's weights stacked into one tensor per projection, in the layout the native
  kernels already read (the skinny kernel's float panels, or a GGUF file's packed blocks), so each projection of
  the layer is ONE native call over all the rows sorted by expert (layers/kernels/csrc: `skinny_linear_experts`,
  `quant_linear_experts`; llama.cpp's ggml_mul_mat_id does the same job) instead of one module call per expert.
  At decode batch 16 the tiny MoE's experts see ~4 rows each, and the per-call overhead (~15 us a kernel call, ~8 us
  a module call) was most of the layer's time.
- `TritonExperts` (CUDA, `--attention-backend triton`): the fused grouped-GEMM kernels of layers/kernels/triton/moe.py.

The experts keep their own modules (the stacked tensors are the storage their weights now view), so the module path
(`run_experts`) stays the reference, runs where a fast path declines a step, and tests/test_moe.py compares the two.
Each row of the native path is computed by the same kernel chain as the module path's, so the two give the same bits.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from lmserve.layers.blocks.moe import Routing, SparseMoE, combine, group_by_expert
from lmserve.layers.formats.gguf_linear import GGUFLinear
from lmserve.layers.formats.linear import SKINNY_MAX_ROWS, PackedLinear
from lmserve.layers.kernels.native import native_module


class StackedPanels(nn.Module):
    """One projection of every expert as skinny-kernel panels [E, N/16, K, 16] (float32)."""

    def __init__(self, linears: list[PackedLinear]) -> None:
        super().__init__()
        self.num_experts, self.out_features = len(linears), linears[0].out_features
        self.register_buffer("panels", torch.stack([lin.panels for lin in linears]))
        for e, lin in enumerate(linears):
            lin.panels = self.panels[e]  # one copy of the weights: each expert's panels view the stack

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, row_experts: torch.Tensor) -> torch.Tensor:
        return native_module().skinny_linear_experts(x, offsets, self.panels, self.out_features)


class StackedGGUF(nn.Module):
    """One projection of every expert in the GGUF kernel's packed layout: codes [E, N/16, K/32, *], scales/mins, and
    the experts' biases [E, N] where they have them (gpt-oss)."""

    def __init__(self, linears: list[GGUFLinear]) -> None:
        super().__init__()
        self.num_experts, self.kind = len(linears), linears[0].kind
        for name in ("codes", "scales", "mins"):
            parts = [getattr(lin, name) for lin in linears]
            self.register_buffer(name, None if parts[0] is None else torch.stack(parts))
            for e, lin in enumerate(linears):
                if parts[0] is not None:
                    setattr(lin, name, getattr(self, name)[e])
        biased = linears[0].bias is not None
        self.register_buffer("bias", torch.stack([lin.bias.detach() for lin in linears]) if biased else None)
        for e, lin in enumerate(linears if biased else ()):
            lin.bias = nn.Parameter(self.bias[e], requires_grad=False)  # one copy: each expert's bias views the stack

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, row_experts: torch.Tensor) -> torch.Tensor:
        y = native_module().quant_linear_experts(x, offsets, self.codes, self.scales, self.mins, self.kind)
        # the kernel adds a bias as one float add after each output's sum: the same bits as this add
        return y if self.bias is None else y + self.bias.index_select(0, row_experts)


def _stackable(linears: list[nn.Module]) -> type[nn.Module] | None:
    """The stacked form these expert projections (one per expert) can share, or None."""
    first = linears[0]
    if all(isinstance(lin, PackedLinear) and lin.panels is not None and lin.bias is None for lin in linears):
        return StackedPanels  # panels exist only where the skinny kernel gives oneDNN's bits (layers/formats/linear.py)
    if all(isinstance(lin, GGUFLinear) and lin.packed and (lin.bias is None) == (first.bias is None)
           and lin.kind == first.kind and lin.codes.shape == first.codes.shape for lin in linears):
        return StackedGGUF
    return None


class NativeExperts(nn.Module):
    """Every expert's gated MLP over its rows in two native calls: gate_up over all rows, act, then down."""

    def __init__(self, gate_up: nn.Module, down: nn.Module, act_and_mul: Callable[[torch.Tensor], torch.Tensor],
                 max_rows: int | None) -> None:
        super().__init__()
        self.gate_up, self.down, self.act_and_mul = gate_up, down, act_and_mul
        # float panels: the skinny kernel rereads a panel per 8 rows, so a step past 8 rows an expert on average (a
        # prefill) runs the module path's oneDNN GEMM, which gives the same bits (layers/formats/linear.py checks it at load)
        self.max_rows = max_rows

    def accepts(self, x: torch.Tensor, routing: Routing) -> bool:
        """Whether this step runs here (else the module path runs it, with the same bits)."""
        rows = routing.experts.numel()
        return native_module() is not None and x.dtype == torch.float32 and (
            self.max_rows is None or rows <= self.max_rows)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        order = group_by_expert(routing, self.gate_up.num_experts)
        rows = x.index_select(0, order.token)  # [T * k, hidden], expert-major
        row_experts = routing.experts.flatten().index_select(0, order.order)  # [T * k]: each sorted row's expert
        h = self.act_and_mul(self.gate_up(rows, order.offsets, row_experts))  # [T * k, I]
        return combine(self.down(h, order.offsets, row_experts), order, routing)


def native_experts(moe: SparseMoE) -> NativeExperts | None:
    """The native grouped path for this layer's experts, where their weight format has one (else None)."""
    if native_module() is None:
        return None
    gate_ups = [expert.gate_up_proj for expert in moe.experts]
    downs = [expert.down_proj for expert in moe.experts]
    kind = _stackable(gate_ups)
    if kind is None or _stackable(downs) is not kind:
        return None
    if kind is StackedGGUF and native_module().quant_packed_rows() == 0:
        return None
    max_rows = SKINNY_MAX_ROWS * len(moe.experts) if kind is StackedPanels else None
    return NativeExperts(kind(gate_ups), kind(downs), moe.experts[0].act_and_mul, max_rows)


def triton_experts(moe: SparseMoE) -> nn.Module | None:
    """The fused Triton path (SwiGLU experts with plain float weights), else None."""
    experts = list(moe.experts)
    plain = all(type(e.gate_up_proj) is nn.Linear and type(e.down_proj) is nn.Linear and e.gate_up_proj.bias is None
                and e.down_proj.bias is None for e in experts)
    if not plain or experts[0].act != "silu":
        return None
    from lmserve.layers.kernels.triton.moe import TritonExperts  # imports triton: only when chosen

    return TritonExperts(experts)


def host_synced_moe_layers(model: nn.Module) -> int:
    """How many mixture-of-experts layers run the module path, which reads each expert's run length on the host (a
    CUDA graph cannot capture that: such a model runs its decode steps eagerly). Only the Triton path is free of it;
    gpt-oss's biased experts have none yet."""
    return sum(isinstance(m, SparseMoE) and not getattr(m.grouped, "graph_safe", False) for m in model.modules())


def apply_moe_kernels(model: nn.Module, triton: bool) -> int:
    """Give every SparseMoE of `model` its fast expert path (Triton's when `triton`, else the native CPU kernels');
    returns how many layers got one. Layers whose weight format has none keep the module path."""
    count = 0
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.grouped = triton_experts(module) if triton else native_experts(module)
            count += module.grouped is not None
    return count
