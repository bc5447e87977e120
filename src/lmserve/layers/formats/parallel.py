"""Tensor parallelism as a transform of a finished model (the model file never knows it is split).

A rank's model is built from its local config (loader/sharding.py): qkv_proj and gate_up_proj are
column-parallel simply by holding this rank's rows, and need no communication (each rank computes its
own heads and its own slice of the MLP). o_proj and down_proj hold this rank's input columns, so each
produces a partial sum of the full output: `RowParallel` wraps them (whatever weight format they were
packed or quantized into) with one all-reduce each, two per layer in all. Their bias is kept on rank 0
only, so the sum adds it once. An MoE layer's experts hold their slices of the intermediate width, so each
expert's down projection is a partial sum too; the router's weights and the shared expert's sigmoid gate are
the same on every rank, so the layer's weighted sum of partial sums is itself a partial sum: the whole
`SparseMoE` is wrapped, one all-reduce per layer as for a dense MLP (not one per expert).

The LM head (and the embedding) stay whole on every rank, and only rank 0 runs the LM head: a
vocab-parallel head would save vocab x hidden / N of memory per rank but cost an all-gather of the
logits every step and LM-head work on every rank; for the models lmserve serves on CPU the head is
small next to the layers, and rank 0 samples alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lmserve.layers.blocks.moe import SparseMoE


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product, then an all-reduce (sum) across the ranks."""

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)  # [T, hidden]: this rank's share of the sum
        dist.all_reduce(y, group=self.group)
        return y


def drop_row_biases(model: nn.Module, rank: int) -> None:
    """Zero o/down biases on ranks other than 0 (before packing): the all-reduce then adds each bias once. An MoE
    layer is all-reduced whole, so each expert's down bias (gpt-oss), scaled by its routing weight, is added once too."""
    if rank == 0:
        return
    with torch.no_grad():
        for layer in model.model.layers:
            if getattr(layer, "absent", False):  # another pipeline rank's (layers/formats/pipeline.py)
                continue
            mlps = list(layer.mlp.experts) if isinstance(layer.mlp, SparseMoE) else [layer.mlp]  # shared: no bias
            for proj in [layer.self_attn.o_proj, *(m.down_proj for m in mlps)]:
                if proj.bias is not None:
                    proj.bias.zero_()


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Wrap every layer's o_proj and down_proj (an MoE layer: the whole layer) in RowParallel (after any weight-format
    transform)."""
    for layer in model.model.layers:
        if getattr(layer, "absent", False):  # another pipeline rank's (layers/formats/pipeline.py)
            continue
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp = RowParallel(layer.mlp, group)
        else:
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    return model
