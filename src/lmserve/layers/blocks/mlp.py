"""The gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one matrix."""

from __future__ import annotations

import torch
from torch import nn

from lmserve.layers.kernels.fused import ACT_AND_MUL


class GatedMLP(nn.Module):
    """SwiGLU (act "silu": Llama, Qwen, Mistral, Phi-3) or GeGLU (act "gelu_tanh": Gemma)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu") -> None:
        super().__init__()
        self.act = act
        self.act_and_mul = ACT_AND_MUL[act]
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, hidden]
