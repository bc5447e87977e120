"""LoRA beside any linear layer: y = base(x) + per-row delta of the row's adapter, in batched form.

`LoraLinear` wraps a finished linear layer of any weight format (nn.Linear, oneDNN-packed, int8/int4) and
never touches its weights: the delta x A^T B^T (scaling folded into B when a slot is written) is added
to the base output. A fused layer (qkv_proj, gate_up_proj) holds several HF projections stacked along
its output; each is a `LoraSlice` with its own A and B, adding only into its part of the output.

Weights live in device slots: A [max_loras, n_slices, max_rank, in], B per slice [max_loras, out_i,
max_rank], zero past an adapter's rank (zero rows add nothing). A step's rows are grouped by slot into
segments (lora/batch.py); the batched path gathers each segment's rows and its slot's A and B and runs
two bmm's for all segments at once (SGMV in spirit: no loop over adapters or requests), then adds the
result into those rows only. Base rows (slot -1) are in no segment: their output is the base layer's,
bit for bit. `lora_delta_reference` is the plain per-row loop the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LoraSlice:
    """One HF projection inside a (possibly fused) linear: its name and its columns of the output."""

    name: str  # q_proj, k_proj, ... down_proj
    offset: int
    size: int


@dataclass
class LoraMeta:
    """One step's rows grouped by adapter slot (numpy from lora/batch.py; tensors once uploaded)."""

    seg_slots: object  # [S] int64: the slot of each segment
    seg_rows: object  # [S, L] int64: the token rows of each segment, padded with its first row
    seg_mask: object  # [S, L, 1] float32: 1 for a real row, 0 for padding (its delta is exactly zero)
    rank: int  # the widest rank among the step's adapters: A and B are read only up to it


class LoraBatch:
    """The current step's LoraMeta, shared by every wrapper; the runner sets it before each forward."""

    def __init__(self) -> None:
        self.meta: LoraMeta | None = None  # None: no row uses an adapter (the wrappers cost nothing)


class LoraLinear(nn.Module):
    """A linear layer of any format plus LoRA deltas for the rows that carry an adapter slot."""

    def __init__(self, base: nn.Module, slices: list[LoraSlice], batch: LoraBatch, max_loras: int, max_rank: int,
                 in_features: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base, self.slices, self.batch = base, slices, batch
        self.register_buffer("lora_a", torch.zeros(max_loras, len(slices), max_rank, in_features, dtype=dtype,
                                                   device=device))
        for i, s in enumerate(slices):  # one B per slice: a fused layer's parts have different heights
            self.register_buffer(f"lora_b{i}", torch.zeros(max_loras, s.size, max_rank, dtype=dtype, device=device))

    def lora_b(self, i: int) -> torch.Tensor:
        return getattr(self, f"lora_b{i}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        meta = self.batch.meta
        if meta is None:
            return y
        return lora_delta_batched(self, x, y, meta)


def lora_delta_batched(layer: LoraLinear, x: torch.Tensor, y: torch.Tensor, meta: LoraMeta) -> torch.Tensor:
    """Add every segment's delta into y (in place) with two bmm's per slice group; x [T, in], y [T, out]."""
    r, n = meta.rank, len(layer.slices)
    a = layer.lora_a[:, :, :r][meta.seg_slots]  # [S, n, r, in]
    xs = x[meta.seg_rows]  # [S, L, in]
    h = torch.bmm(xs, a.reshape(a.shape[0], n * r, -1).transpose(1, 2))  # [S, L, n * r]
    h = h * meta.seg_mask.to(h.dtype)  # padding rows: exactly zero from here on
    rows = meta.seg_rows.reshape(-1)
    for i, s in enumerate(layer.slices):
        b = layer.lora_b(i)[:, :, :r][meta.seg_slots]  # [S, out_i, r]
        d = torch.bmm(h[:, :, i * r:(i + 1) * r], b.transpose(1, 2))  # [S, L, out_i]
        y[:, s.offset:s.offset + s.size].index_add_(0, rows, d.reshape(-1, s.size).to(y.dtype))
    return y


def lora_delta_reference(layer: LoraLinear, x: torch.Tensor, y: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    """The plain path: row by row, y[t] += x[t] A^T B^T of row t's slot (the batched path must match it)."""
    y = y.clone()
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for i, s in enumerate(layer.slices):
            h = x[t] @ layer.lora_a[slot, i].T  # [max_rank]
            y[t, s.offset:s.offset + s.size] += (h @ layer.lora_b(i)[slot].T).to(y.dtype)
    return y
