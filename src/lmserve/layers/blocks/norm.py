"""RMSNorm, fused with the residual add that comes before it, and LayerNorm (both run by layers/kernels/fused.py)."""

from __future__ import annotations

import torch
from torch import nn

from lmserve.layers.kernels.fused import layer_norm, rms_norm, rms_norm_ref


class RMSNorm(nn.Module):
    """Root-mean-square norm scaled by (offset + w): offset 0 for Llama's weights, 1 for Gemma's."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def scale(self) -> torch.Tensor:
        """The multiplier after normalising: w, or offset + w (computed in the weight's dtype, float32 on CPU)."""
        return self.weight + self.offset if self.offset else self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the new residual stream comes back with the normed input."""
        if self.offset and x.dtype != torch.float32:  # Gemma in half precision: (1 + w) and the product in float32
            residual = x if residual is None else residual + x
            return rms_norm_ref(residual.float(), self.weight.float() + self.offset, self.eps).to(x.dtype), residual
        return rms_norm(x, self.scale(), self.eps, residual)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (the same parameters and names), computed by layers/kernels/fused.py `layer_norm`: one native call
    on CPU float32, F.layer_norm elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalized_shape != (x.shape[-1],):
            return super().forward(x)
        return layer_norm(x, self.weight, self.bias, self.eps)
