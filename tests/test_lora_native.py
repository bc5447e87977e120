"""The native LoRA delta (layers/kernels/csrc/lora_delta.cpp, through lora/layers.lora_delta_native): the plain
per-row reference's numbers, base rows untouched, and each row's delta bit-identical in any batch (batch invariance:
the rows beside it, their adapters, the step's widest rank). The bmm path (other devices) keeps its own check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lmserve.layers.kernels.native import native_module
from lmserve.lora.batch import lora_segments
from lmserve.lora.layers import LoraBatch, LoraLinear, LoraSlice, lora_delta_batched, lora_delta_reference
from lmserve.worker.upload import to_device

CPU = torch.device("cpu")
needs_native = pytest.mark.skipif(native_module() is None, reason="native kernels unavailable (no compiler)")


def _layer(in_features: int = 72, sizes: tuple[int, ...] = (96, 32, 32), loras: int = 4, rank: int = 16,
           zero_base: bool = False):
    """A fused linear with random slots; slot s's adapter has rank 4 * (s + 1) (zero past it, as slots are written).
    `zero_base`: the base outputs exact zeros (BLAS's own sums are not batch-invariant), so y is the delta alone."""
    torch.manual_seed(0)
    base = nn.Linear(in_features, sum(sizes), bias=True)
    if zero_base:
        nn.init.zeros_(base.weight)
        nn.init.zeros_(base.bias)
    offsets = np.cumsum((0,) + sizes)
    slices = [LoraSlice(f"p{i}", int(offsets[i]), n) for i, n in enumerate(sizes)]
    layer = LoraLinear(base, slices, LoraBatch(), max_loras=loras, max_rank=rank, in_features=in_features,
                       dtype=torch.float32, device=CPU)
    ranks = [min(4 * (s + 1), rank) for s in range(loras)]
    with torch.no_grad():
        layer.lora_a.normal_()
        for i in range(len(sizes)):
            layer.lora_b(i).normal_()
        for s, r in enumerate(ranks):
            layer.lora_a[s, r:].zero_()
            for i in range(len(sizes)):
                layer.lora_b(i)[s, r:].zero_()
    return layer, ranks


def _run(layer: LoraLinear, x: torch.Tensor, slots: list[int], ranks: list[int]) -> torch.Tensor:
    layer.batch.meta = to_device(lora_segments(np.asarray(slots, dtype=np.int64), ranks), CPU)
    with torch.inference_mode():
        return layer(x)


@needs_native
def test_native_delta_matches_the_reference_and_keeps_base_rows():
    layer, ranks = _layer()
    x = torch.randn(13, 72)
    slots = [-1, 0, 2, 2, -1, 1, 0, 0, 3, 2, -1, 3, 1]
    y_base = layer.base(x)
    y = _run(layer, x, slots, ranks)
    assert layer.batch.meta.slots is not None
    base_rows = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(y[base_rows], y_base[base_rows]), "base rows are the base layer's output, bit for bit"
    torch.testing.assert_close(y, lora_delta_reference(layer, x, y_base, slots), rtol=1e-5, atol=1e-4)
    assert all(not torch.allclose(y[t], y_base[t]) for t, s in enumerate(slots) if s >= 0)


@needs_native
@pytest.mark.parametrize("in_features", [72, 576, 1536])
def test_a_rows_delta_is_the_same_in_any_batch(in_features):
    """Row 0 (slot 1) alone, beside rows of its own adapter, of others of wider rank, and of base rows, at other
    positions: bit-identical every time."""
    layer, ranks = _layer(in_features, (64, 48), zero_base=True)
    g = torch.Generator().manual_seed(1)
    row = torch.randn(1, in_features, generator=g)
    alone = _run(layer, row, [1], ranks)
    for others, slots in [(7, [1, 1, 1, 1, 1, 1, 1]), (9, [3, 1, 2, -1, 0, 3, 3, 1, -1]),
                          (31, [(t % 5) - 1 for t in range(31)])]:
        rest = torch.randn(others, in_features, generator=g)
        for pos in (0, others // 2, others):
            x = torch.cat([rest[:pos], row, rest[pos:]])
            y = _run(layer, x, slots[:pos] + [1] + slots[pos:], ranks)
            assert torch.equal(y[pos], alone[0]), (others, pos)


def test_the_bmm_path_matches_the_reference():
    """lora_delta_batched serves other devices and dtypes: padded segments and one slot at a time."""
    layer, ranks = _layer()
    x = torch.randn(11, 72)
    slots = [-1, 0, 2, 2, -1, 1, 0, 0, 0, 2, -1]
    y_base = layer.base(x).detach()
    ref = lora_delta_reference(layer, x, y_base, slots)
    for padding in (2.0, 1.0):
        meta = to_device(lora_segments(np.asarray(slots), ranks, max_padding=padding), CPU)
        with torch.inference_mode():
            y = lora_delta_batched(layer, x, y_base.clone(), meta)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
