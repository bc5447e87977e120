"""A linear layer and what follows it, an activation or a residual add, in one call where the weight format can.

An encoder's MLP writes its up projection's [T, intermediate] output, then reads it and writes it again for the
activation; each sublayer's output is read and written once more for the residual add. With a step of 2,048
tokens those tensors are past the caches, so the extra passes run at memory speed. oneDNN's packed linear
(layers/formats/linear.py `PackedLinear`) applies the activation or the add to each output tile while it is
still in registers (its post-ops): all-MiniLM-L6-v2's MLP over 2,048 tokens took 27-31 ms as four calls and
24-26 ms as two fused ones (2 threads, Zen 4; benchmarks/results/encoder_throughput_zen4.md). The composed calls,
`ACTS[act](linear(x))` and `linear(x) + residual`, are the reference (tests/test_fused_linear.py compares them) and
what every other weight format runs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.layers.formats.linear import SKINNY_MAX_ROWS, PackedLinear

# the encoders' activations by their config.json names
ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "swish": F.silu, "relu": F.relu}
# those oneDNN applies as eltwise post-ops: (attr, algorithm)
_POST_OPS = {"gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"), "gelu_pytorch_tanh": ("gelu", "tanh"),
             "relu": ("relu", "")}


def _fusable(linear: nn.Module, x: torch.Tensor, op: str) -> bool:
    """A PackedLinear running oneDNN for this step. Where the skinny kernel takes small steps (the composed calls,
    whose rows it matches bit for bit: checked at load), a larger step fuses only if the fused op gives the composed
    calls' bits for this layer (`_exact`), so a row's numbers never depend on the step's size."""
    if type(linear) is not PackedLinear or x.dim() != 2:
        return False
    if linear.panels is None:
        return True
    return x.shape[0] > linear.skinny_rows and _exact(linear, op)


def _exact(linear: PackedLinear, op: str) -> bool:
    """True when `op` (an ACTS name, or "add") fused gives the composed calls' bits on this layer, checked once per
    layer and op: oneDNN's erf GELU, ReLU and add matched torch's on the CPUs measured, its tanh GELU did not."""
    checked = linear.__dict__.setdefault("_post_op_exact", {})
    if op not in checked:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(SKINNY_MAX_ROWS + 8, linear.in_features, generator=gen).to(linear.packed.dtype)
        if op == "add":
            residual = torch.randn(x.shape[0], linear.out_features, generator=gen).to(x.dtype)
            fused, composed = _add(linear, x, residual), linear(x) + residual
        else:
            fused, composed = _act(linear, x, op), ACTS[op](linear(x))
        checked[op] = torch.equal(fused, composed)
    return checked[op]


def _act(linear: PackedLinear, x: torch.Tensor, act: str) -> torch.Tensor:
    attr, algorithm = _POST_OPS[act]
    return torch.ops.mkldnn._linear_pointwise(x, linear.packed, linear.bias, attr, [], algorithm)


def _add(linear: PackedLinear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, linear.packed, linear.bias, "add")


def linear_act(linear: nn.Module, x: torch.Tensor, act: str) -> torch.Tensor:
    """ACTS[act](linear(x)), the activation fused into the GEMM where `linear` is oneDNN's."""
    if act in _POST_OPS and _fusable(linear, x, act):
        return _act(linear, x, act)
    return ACTS[act](linear(x))


def linear_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """linear(x) + residual (same shape as the output), the add fused into the GEMM where `linear` is oneDNN's."""
    if residual.dtype == x.dtype and residual.is_contiguous() and _fusable(linear, x, "add"):
        return _add(linear, x, residual)
    return linear(x) + residual
