"""A linear layer and what follows it, an activation or a residual add, in one call where the weight format can.

An encoder's MLP writes its up projection's [T, intermediate] output, then reads it and writes it again for the
activation; each sublayer's output is read and written once more for the residual add. With a step of 2,048
tokens those tensors are past the caches, so the extra passes run at memory speed. oneDNN's packed linear
(layers/formats/linear.py `PackedLinear`) applies the activation or the add to each output tile while it is
still in registers (its post-ops): all-MiniLM-L6-v2's MLP over 2,048 tokens took 27-31 ms as four calls and
24-26 ms as two fused ones (2 threads, Zen 4; benchmarks/results/encoder_throughput_zen4.md). The composed calls, `ACTS[act](linear(x))` and `linear(x) + residual`, are
the reference (tests/test_fused_linear.py compares them) and what every other weight format runs.
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


def _fusable(linear: nn.Module, x: torch.Tensor) -> bool:
    """A PackedLinear running oneDNN for this step: a step the skinny kernel takes keeps the composed calls, whose
    rows it matches bit for bit (checked at load), so a row's numbers never depend on the step's size."""
    if type(linear) is not PackedLinear or x.dim() != 2:
        return False
    return linear.panels is None or x.shape[0] > SKINNY_MAX_ROWS


def linear_act(linear: nn.Module, x: torch.Tensor, act: str) -> torch.Tensor:
    """ACTS[act](linear(x)), the activation fused into the GEMM where `linear` is oneDNN's."""
    if act in _POST_OPS and _fusable(linear, x):
        attr, algorithm = _POST_OPS[act]
        return torch.ops.mkldnn._linear_pointwise(x, linear.packed, linear.bias, attr, [], algorithm)
    return ACTS[act](linear(x))


def linear_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """linear(x) + residual (same shape as the output), the add fused into the GEMM where `linear` is oneDNN's."""
    if _fusable(linear, x) and residual.dtype == x.dtype and residual.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, linear.packed, linear.bias, "add")
    return linear(x) + residual
