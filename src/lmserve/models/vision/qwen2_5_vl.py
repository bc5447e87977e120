"""Qwen2.5-VL's vision transformer: dynamic resolution, 2D rotary, windowed attention with a few full-attention
blocks, and a patch merger that folds each 2x2 block of patches into one text-model token.

Input is the processor's flat patch list (pixel_values [patches, 3*2*14*14], patches in 2x2 merge-block order) and
each image's grid (t, h, w) in patches. Patches are reordered window by window (a window is 112px: 4x4 merge
blocks) so that every windowed block attends within contiguous segments; full-attention blocks (fullatt_block_indexes)
attend within each image. The merger's output is put back in the processor's order and split per image:
`Qwen25VisionTransformer.encode_images(pixel_values, grids) -> [t*h*w/4, out_hidden] per image`. Parameter names
follow transformers' `visual.*` (patch_embed.proj, blocks.N.attn.qkv, blocks.N.mlp.gate_proj, merger.ln_q, merger.mlp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .vit import ACTIVATIONS
from .weights import load_vision

Grid = tuple[int, int, int]  # (t, h, w) in patches


@dataclass(frozen=True)
class Qwen25VisionConfig:
    """The fields of a Qwen2.5-VL `vision_config`."""

    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    act: str
    out_hidden_size: int
    fullatt_blocks: tuple[int, ...]
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    window_size: int = 112  # pixels
    rope_theta: float = 10000.0
    in_channels: int = 3

    @classmethod
    def from_hf(cls, vc) -> Qwen25VisionConfig:
        """From a transformers Qwen2_5_VLVisionConfig."""
        rope = getattr(vc, "rope_parameters", None) or {}
        return cls(vc.hidden_size, vc.intermediate_size, vc.depth, vc.num_heads, vc.hidden_act, vc.out_hidden_size,
                   tuple(vc.fullatt_block_indexes), vc.patch_size, vc.temporal_patch_size, vc.spatial_merge_size,
                   vc.window_size, rope.get("rope_theta", 10000.0), vc.in_channels)


class RMSNorm(nn.Module):
    """Qwen's RMSNorm (normalised in float32, weight applied in the input dtype)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotary_positions(grids: list[Grid], merge: int) -> torch.Tensor:
    """[patches, 2] (row, column) of each patch, in the processor's merge-block order, repeated per frame."""
    out = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        pos = torch.stack([a.reshape(blocks).transpose(1, 2).flatten() for a in (rows, cols)], -1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


def window_order(grids: list[Grid], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks reordered window by window (window = merge blocks per side), and the windows' cumulative
    lengths in patches (the segments windowed attention runs over)."""
    order, cu, base = [], [0], 0
    for t, h, w in grids:
        lh, lw = h // merge, w // merge
        blocks = torch.arange(t * lh * lw).view(t, lh, lw) + base
        for f in range(t):
            for r in range(0, lh, window):
                for c in range(0, lw, window):
                    win = blocks[f, r:r + window, c:c + window].flatten()
                    order.append(win)
                    cu.append(cu[-1] + win.numel() * merge * merge)
        base += t * lh * lw
    return torch.cat(order), cu


def image_segments(grids: list[Grid]) -> list[int]:
    """Cumulative lengths of each frame of each image: the segments full attention runs over."""
    cu = [0]
    for t, h, w in grids:
        cu += [cu[-1] + h * w * (i + 1) for i in range(t)]
    return cu


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Bidirectional attention within each segment [cu[i], cu[i+1]); segments of one length run as one batch.
    q, k, v: [tokens, heads, head_dim] -> [tokens, heads, head_dim]."""
    out = torch.empty_like(q)
    starts, lengths = torch.tensor(cu[:-1]), torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    for n in lengths.unique().tolist():
        if n == 0:
            continue
        idx = (starts[lengths == n][:, None] + torch.arange(n)).flatten()  # [segments * n]
        qs, ks, vs = (x[idx].view(-1, n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))  # [segs, heads, n, d]
        out[idx] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the whole head dim, halves rotated.
    x [tokens, heads, head_dim]; cos, sin [tokens, head_dim]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    """Fused qkv, 2D rotary, attention within the given segments, output projection."""

    def __init__(self, cfg: Qwen25VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cu: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [tokens, heads, head_dim]
        out = segment_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, cu)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """Gated MLP with biases: down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: Qwen25VisionConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.act]
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-RMSNorm block: attention within segments, then the gated MLP."""

    def __init__(self, cfg: Qwen25VisionConfig):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.hidden_size), RMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cu: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm, then each merge block's merge^2 patches concatenated and taken through a GELU MLP to the text width."""

    def __init__(self, cfg: Qwen25VisionConfig):
        super().__init__()
        self.width = cfg.hidden_size * cfg.merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride over each (channels, temporal, patch, patch) patch: a linear map."""

    def __init__(self, cfg: Qwen25VisionConfig):
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return x.to(w.dtype) @ w.view(w.shape[0], -1).T  # [patches, hidden]


class Qwen25VisionTransformer(nn.Module):
    """Qwen2.5-VL's ViT plus patch merger: flat patches and grids in, text-model embeddings per image out."""

    def __init__(self, cfg: Qwen25VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        quarter = cfg.hidden_size // cfg.num_heads // 2
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, quarter, 2).float() / quarter),
                             persistent=False)

    def _rotary(self, grids: list[Grid], order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim] in window order: row angles then column angles, the pair repeated."""
        # positions are made on the host: [patches, 2, d/4] on the tower's device
        freqs = rotary_positions(grids, self.cfg.merge_size).to(self.inv_freq.device)[..., None].float() * self.inv_freq
        freqs = self._to_windows(freqs.flatten(1), order)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def _to_windows(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        unit = self.cfg.merge_size ** 2
        return x.view(-1, unit, x.shape[-1])[order].view(-1, x.shape[-1])

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """[patches, 3*t*p*p] -> [patches / merge^2, out_hidden], merged tokens in the processor's order."""
        window = self.cfg.window_size // self.cfg.merge_size // self.cfg.patch_size
        order, cu_windows = window_order(grids, self.cfg.merge_size, window)
        order = order.to(pixel_values.device)  # made on the host, gathers the tower's rows
        cu_images = image_segments(grids)
        cos, sin = self._rotary(grids, order)
        x = self._to_windows(self.patch_embed(pixel_values), order)
        for i, block in enumerate(self.blocks):
            x = block(x, cu_images if i in self.cfg.fullatt_blocks else cu_windows, cos, sin)
        return self.merger(x)[torch.argsort(order)]

    def encode_images(self, pixel_values: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
        """One [t*h*w / merge^2, out_hidden] tensor per image."""
        sizes = [t * h * w // self.cfg.merge_size ** 2 for t, h, w in grids]
        return list(self.forward(pixel_values, grids).split(sizes))

    def load_hf_weights(self, tensors) -> None:
        """Load from a Qwen2.5-VL checkpoint's tensors (`visual.*` or `model.visual.*`; the text's are ignored)."""
        load_vision(self, tensors, {"visual.": ""})
