"""LoRA beside any linear layer: y = base(x) + per-row delta of the row's adapter, in batched form.

`LoraLinear` wraps a finished linear layer of any weight format (nn.Linear, oneDNN-packed, int8/int4) and
never touches its weights: the delta x A^T B^T (scaling folded into B when a slot is written) is added
to the base output. A fused layer (qkv_proj, gate_up_proj) holds several HF projections stacked along
its output; each is a `LoraSlice` with its own A and B, adding only into its part of the output.

Weights live in device slots: A [max_loras, max_rank, n_slices, in] (rank-major, so the first r ranks of
every slice are one contiguous [r * n_slices, in] block per slot: no copy when a step's widest rank is r),
B transposed per slice [max_loras, max_rank, out_i] (also rank-major), zero past an adapter's rank (zero
rows add nothing). A step's rows are grouped by slot into segments over the slots 0..S-1 (lora/batch.py; slots are handed out lowest
first, so that prefix is short); the batched path gathers each segment's rows and runs one bmm for the
shrink and one per slice for the expand over all segments at once against views of the slot tensors (SGMV
in spirit: no loop over adapters or requests, no copy of the weights), then one index_add into those rows.
A step whose padding would more than double the rows (a long prefill chunk beside one-row decodes) runs one
matmul pair per used slot instead (`ragged`).
Base rows (slot -1) are in no segment: their output is the base layer's, bit for bit. Measured on one
[32 x 576] -> 3072 gate_up layer with 8 rank-16 adapters (1 thread): gathering each segment's weights and
adding slice by slice cost 2.4 ms over a 2.9 ms base; with these views, B rank-major (the expand bmm
went 186 -> 54 us) and one index_add, 0.65 ms over 2.0 ms.
`lora_delta_reference` is the plain per-row loop the tests compare against.

On the CPU in float32 the deltas go through one native kernel instead (`lora_delta_native`, csrc/lora_delta.cpp:
float32, each row in a fixed order, rows sharing a slot together), the one the native decode stack calls, so a
decode step with adapter rows stays in the stack and a row's delta is the same in any batch. The bmm path below
serves other devices and dtypes (and the native kernels switched off). Its rows are not batch-invariant: BLAS picks its summation order by the call's shape, and on a
Zen 5 host (MKL) one row came out of these bmm's with other last bits at 1, 2-4 and 5+ rows per segment and at
another rank width (the widest rank of the step). Over a float base that stays a last-bit difference; over a GGUF
base the int8 activations can turn it into ~0.1 of a continuation's logprob (tokens equal in the test that showed
it). Computing the deltas in float64 removed it, but cost the 8-adapter benchmark 0.32x -> 0.25x of the base's
tokens/s and twice the slot memory; a fixed-order kernel is what would make it exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmserve.layers.kernels.native import LORA_SLOT_DTYPES, native_module


@dataclass(frozen=True)
class LoraSlice:
    """One HF projection inside a (possibly fused) linear: its name and its columns of the output."""

    name: str  # q_proj, k_proj, ... down_proj
    offset: int
    size: int


@dataclass
class LoraMeta:
    """One step's rows grouped by adapter slot (numpy from lora/batch.py; tensors once uploaded)."""

    seg_rows: object  # [S, L] int64: segment s holds the token rows of slot s, padded (S = highest used slot + 1)
    seg_mask: object  # [S, L, 1] float32: 1 for a real row, 0 for padding (its delta is exactly zero)
    flat_rows: object  # [S * L] int64: seg_rows flattened (where the deltas are added)
    rank: int  # the widest rank among the step's adapters: A and B are read only up to it
    padded: bool  # some segment has padding: the mask must be applied
    # Set instead of the padded segments when padding would more than double the rows (a prefill chunk
    # beside one-row decodes): (slot, its rows [n_s] int64) per used slot, each run on its own
    ragged: list[tuple[int, object]] | None = None
    slots: object = None  # [T] int64: each row's slot (-1: base), for the native kernel (lora_delta_native)


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
        self.register_buffer("lora_a", torch.zeros(max_loras, max_rank, len(slices), in_features, dtype=dtype,
                                                   device=device))
        for i, s in enumerate(slices):  # one B^T per slice: a fused layer's parts have different heights
            self.register_buffer(f"lora_b{i}", torch.zeros(max_loras, max_rank, s.size, dtype=dtype, device=device))

    def lora_b(self, i: int) -> torch.Tensor:
        """Slice i's B transposed (scaling folded in): [max_loras, max_rank, out_i]."""
        return getattr(self, f"lora_b{i}")

    @property
    def passes_through(self) -> bool:
        """No row of this step carries an adapter: the output is the base layer's alone (the decode stack then runs
        the base, layers/kernels/decode_stack.py)."""
        return self.batch.meta is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        meta = self.batch.meta
        if meta is None:
            return y
        if lora_delta_native(self, x, y, meta):
            return y
        return lora_delta_batched(self, x, y, meta)


def lora_delta_native(layer: LoraLinear, x: torch.Tensor, y: torch.Tensor, meta: LoraMeta) -> bool:
    """Add the deltas into y in place through the native kernel (CPU float32; layers/kernels/csrc/lora_delta.cpp),
    the one the native decode stack calls: a fixed order per row, so a row's delta does not depend on its batch and
    a decode step's outputs are the same in the stack and in this module loop. False where it does not apply."""
    mod = native_module()
    if mod is None or meta.slots is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 \
            or y.dtype != torch.float32 or y.dim() != 2 or layer.lora_a.dtype not in LORA_SLOT_DTYPES:
        return False
    mod.lora_delta_(y, x if x.stride(1) == 1 else x.contiguous(), meta.slots, layer.lora_a,
                    [layer.lora_b(i) for i in range(len(layer.slices))], meta.rank)
    return True


def lora_delta_batched(layer: LoraLinear, x: torch.Tensor, y: torch.Tensor, meta: LoraMeta) -> torch.Tensor:
    """Add every segment's delta into y (in place): x [T, in], y [T, out]."""
    if meta.ragged is not None:
        return _lora_delta_ragged(layer, x, y, meta)
    r, n = meta.rank, len(layer.slices)
    num_segs = meta.seg_rows.shape[0]
    a = layer.lora_a[:num_segs, :r].reshape(num_segs, r * n, -1)  # [S, r * n, in], a view: rank-major layout
    h = torch.bmm(x[meta.seg_rows], a.transpose(1, 2).to(x.dtype))  # [S, L, r * n]; column k * n + i: slice i, rank k
    if meta.padded:
        h = h * meta.seg_mask.to(h.dtype)  # padding rows: exactly zero from here on
    parts = [torch.bmm(h[:, :, i::n].contiguous(), layer.lora_b(i)[:num_segs, :r].to(h.dtype))  # [S, L, out_i]
             for i in range(n)]
    d = parts[0] if n == 1 else torch.cat(parts, dim=-1)  # [S, L, out]: slices are stacked in output order
    return y.index_add_(0, meta.flat_rows, d.reshape(-1, y.shape[-1]).to(y.dtype))


def _lora_delta_ragged(layer: LoraLinear, x: torch.Tensor, y: torch.Tensor, meta: LoraMeta) -> torch.Tensor:
    """One matmul pair per used slot over its own rows: no padding rows computed."""
    r, n = meta.rank, len(layer.slices)
    for slot, rows in meta.ragged:
        h = x[rows] @ layer.lora_a[slot, :r].reshape(r * n, -1).T.to(x.dtype)  # [n_s, r * n]
        parts = [h[:, i::n] @ layer.lora_b(i)[slot, :r].to(h.dtype) for i in range(n)]  # [n_s, out_i]
        d = parts[0] if n == 1 else torch.cat(parts, dim=-1)
        y.index_add_(0, rows, d.to(y.dtype))
    return y


def lora_delta_reference(layer: LoraLinear, x: torch.Tensor, y: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    """The plain path: row by row, y[t] += x[t] A^T B^T of row t's slot (the batched path must match it)."""
    y = y.clone()
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for i, s in enumerate(layer.slices):
            h = x[t] @ layer.lora_a[slot, :, i].T.to(x.dtype)  # [max_rank]
            y[t, s.offset:s.offset + s.size] += (h @ layer.lora_b(i)[slot].to(h.dtype)).to(y.dtype)
    return y
