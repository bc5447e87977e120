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
from lmserve.worker.transforms import lora_slot_dtype
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


@needs_native
@pytest.mark.parametrize("in_features", [576, 83])  # 83: the lanes' tail (fold) reads 16-bit A one value at a time
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_slots_are_widened_exactly_into_the_float32_chain(dtype, in_features):
    """--lora-dtype float16 / bfloat16: the kernel widens each slot weight exactly as it loads it and runs the float32
    chain, so 16-bit slots give the bits of float32 slots holding the same (rounded) values, in any batch, and the
    reference's numbers."""
    wide, ranks = _layer(in_features, (64, 48, 21), zero_base=True)  # BLAS's base outputs are not batch-invariant
    narrow = LoraLinear(wide.base, wide.slices, LoraBatch(), max_loras=4, max_rank=16, in_features=in_features,
                        dtype=dtype, device=CPU)
    with torch.no_grad():
        narrow.lora_a.copy_(wide.lora_a)
        wide.lora_a.copy_(narrow.lora_a.float())  # float32 slots holding the rounded values
        for i in range(3):
            narrow.lora_b(i).copy_(wide.lora_b(i))
            wide.lora_b(i).copy_(narrow.lora_b(i).float())
    assert narrow.lora_a.dtype == dtype and not torch.equal(wide.lora_a, torch.zeros_like(wide.lora_a))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(13, in_features, generator=g)
    slots = [-1, 0, 2, 2, -1, 1, 0, 0, 3, 2, -1, 3, 1]
    y = _run(narrow, x, slots, ranks)
    assert torch.equal(y, _run(wide, x, slots, ranks))
    torch.testing.assert_close(y, lora_delta_reference(narrow, x, narrow.base(x), slots), rtol=1e-5, atol=1e-4)
    assert torch.equal(_run(narrow, x[2:3], [2], ranks)[0], y[2]), "a row's delta is the same alone"
    meta = to_device(lora_segments(np.asarray(slots), ranks), CPU)  # the bmm path (other devices) casts the slots
    with torch.inference_mode():
        torch.testing.assert_close(lora_delta_batched(narrow, x, narrow.base(x), meta), y, rtol=1e-5, atol=1e-4)


def test_lora_dtype_auto_is_float16_over_a_quantized_cpu_base_only():
    """auto: float16 slots where the base's weights stay in quantized blocks on a CPU (float32 activations), else the
    parameters' dtype; a name is taken as given."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for quantization in ("gguf", "int8", "int4", "gptq"):
        assert lora_slot_dtype("auto", torch.float32, cpu, quantization) == torch.float16
    assert lora_slot_dtype("auto", torch.float32, cpu, None) == torch.float32  # a float base: float32 everywhere
    assert lora_slot_dtype("auto", torch.bfloat16, cpu, None) == torch.bfloat16
    assert lora_slot_dtype("auto", torch.bfloat16, cuda, "gptq") == torch.bfloat16
    assert lora_slot_dtype("float32", torch.float32, cpu, "gguf") == torch.float32
    assert lora_slot_dtype("bfloat16", torch.float32, cpu, None) == torch.bfloat16
    # a build that widens float16 one value at a time (x86-64-v2) or no native kernels: float32 slots stay faster
    assert lora_slot_dtype("auto", torch.float32, cpu, "gguf", fast_half=False) == torch.float32
    assert lora_slot_dtype("float16", torch.float32, cpu, "gguf", fast_half=False) == torch.float16
