"""SigLIP's vision transformer (as Idefics3 / SmolVLM extend it): patch embedding by a strided convolution,
learned position embeddings, pre-LayerNorm encoder layers with bidirectional attention, a final LayerNorm.

Parameter names are HF's (`embeddings.patch_embedding`, `encoder.layers.{i}.self_attn.q_proj`, `post_layernorm`),
so the checkpoint loads by name. Idefics3's position ids bucket each patch's fractional coordinate onto the
trained grid (NaViT-style, for frames smaller than `image_size`); for a full frame they are the grid itself, but
they are computed the same way, in the same float32 steps, so every frame gets exactly transformers' ids.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.models.config import VisionConfig

_ACT = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


class SiglipAttention(nn.Module):
    """Multi-head attention over one frame's patches, every patch seeing every other (no mask, no rotary)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape  # [frames, patches, hidden]
        q, k, v = (p(x).view(b, n, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # [frames, heads, patches, head_dim]
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = _ACT[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_layers))


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_size, self.side = cfg.patch_size, cfg.patches_per_side
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(self.side ** 2, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[frames, 3, H, W] -> [frames, patches, hidden]; every patch of every frame is real (no padding)."""
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        nh, nw = pixel_values.shape[-2] // self.patch_size, pixel_values.shape[-1] // self.patch_size
        return x + self.position_embedding(self._position_ids(nh, nw, x.device))

    def _position_ids(self, nh: int, nw: int, device: torch.device) -> torch.Tensor:
        """[nh * nw] grid ids: each patch's fractional row/column bucketed onto the trained side x side grid."""
        bounds = torch.arange(1 / self.side, 1.0, 1 / self.side, device=device)

        def buckets(n: int) -> torch.Tensor:
            step = 1.0 / torch.tensor([n], device=device)  # float32, as transformers divides
            frac = (torch.arange(n, device=device, dtype=torch.float32) * step).clamp(max=1.0 - 1e-6)
            return torch.bucketize(frac, bounds, right=True)

        return (buckets(nh)[:, None] * self.side + buckets(nw)[None, :]).reshape(-1)


class SiglipVisionTower(nn.Module):
    """Frames -> patch features [frames, patches, hidden] (HF's `vision_model`)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
