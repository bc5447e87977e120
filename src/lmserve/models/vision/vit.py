"""The pre-norm ViT encoder shared by CLIP and SigLIP towers: LayerNorm -> attention -> LayerNorm -> MLP, residuals.

Parameter names follow transformers' CLIP/SigLIP encoders (`layers.N.self_attn.q_proj`, `layer_norm1`, `mlp.fc1`)
so a checkpoint's tensors load by name. Attention is bidirectional over one image's patches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "gelu": F.gelu,
    "quick_gelu": quick_gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


@dataclass(frozen=True)
class ViTConfig:
    """One ViT encoder's shape (the fields of a CLIP/SigLIP `vision_config`)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    act: str
    eps: float

    @classmethod
    def from_hf(cls, vc) -> ViTConfig:
        """From a transformers vision config (CLIPVisionConfig, SiglipVisionConfig)."""
        return cls(vc.hidden_size, vc.intermediate_size, vc.num_hidden_layers, vc.num_attention_heads,
                   vc.hidden_act, vc.layer_norm_eps)


class ViTAttention(nn.Module):
    """Multi-head self-attention with biased q/k/v/out projections."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        d = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape  # [images, patches, hidden]
        q, k, v = (p(x).view(b, n, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # [images, heads, patches, head_dim]
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class ViTMLP(nn.Module):
    """fc1 -> activation -> fc2."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.act]
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ViTLayer(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)
        self.self_attn = ViTAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)
        self.mlp = ViTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ViTEncoder(nn.Module):
    """A stack of ViTLayers; `forward` returns every hidden state, as transformers' `hidden_states` tuple does."""

    def __init__(self, cfg: ViTConfig, num_layers: int | None = None):
        super().__init__()
        self.layers = nn.ModuleList(ViTLayer(cfg) for _ in range(cfg.num_layers if num_layers is None else num_layers))

    def forward(self, x: torch.Tensor, keep: int | None = None) -> list[torch.Tensor]:
        """[input, after layer 1, ..., after layer `keep`] (all layers when keep is None)."""
        states = [x]
        for layer in self.layers[:keep]:
            states.append(layer(states[-1]))
        return states
