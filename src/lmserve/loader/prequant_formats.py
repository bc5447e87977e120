"""Each pre-quantized checkpoint format's tensors for one linear layer -> `IntWeights` (layers/formats/int_weights.py).

The packings, for a layer with N output rows and K input columns, `bits`-bit codes, G = K / group:
- GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [K * bits / 32, N], the codes of 32 / bits consecutive input
  columns per word, column k at bit bits * (k % (32 / bits)); `qzeros` int32 [G, N * bits / 32], packed the same
  way along the rows; `scales` [G, N]; `g_idx` [K] (the group of each column). The v1 format (checkpoint_format
  "gptq", the default) stores zero - 1, read back as (stored + 1) mod 2**bits as AutoGPTQ's own kernels do;
  "gptq_v2" stores the zero itself.
- AWQ (AutoAWQ, version "gemm"): `qweight` int32 [K, N / 8] and `qzeros` int32 [G, N / 8], 8 output rows per word
  in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds row 8j + that order's i-th entry); `scales` [G, N].
- compressed-tensors (llm-compressor), "pack-quantized": `weight_packed` int32 [N, K * bits / 32], codes stored as
  code + 2**(bits - 1) in dense little-endian order; `weight_scale` [N, G] ([N, 1] channel-wise, one value
  per tensor); `weight_zero_point` (asymmetric) packed the same way along the rows, [N * bits / 32, G];
  `weight_shape` [2]. "int-quantized" / "naive-quantized": `weight` int8 [N, K] with the same scales.
  "float-quantized": `weight` float8_e4m3fn with scales per tensor, row, group or [row, column] block: no
  integer codes, so `read_fp8` dequantizes it (there is no FP8 kernel on the CPU).
Every format computes w = scale * (q - zero); the readers only move the integers into one layout.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from lmserve.errors import CheckpointError
from lmserve.layers.formats.int_weights import IntWeights

AWQ_ROW_OF_NIBBLE = np.argsort([0, 2, 4, 6, 1, 3, 5, 7])  # output row 8j + r sits in nibble AWQ_ROW_OF_NIBBLE[r]


class Tensors(Protocol):
    """Named tensors of a checkpoint, read on demand."""

    def get(self, name: str) -> torch.Tensor: ...

    def __contains__(self, name: str) -> bool: ...


def unpack_int32(words: torch.Tensor, bits: int) -> np.ndarray:
    """int32 [R, C] -> uint8 [R, C * 32 / bits]: the codes of each word, lowest bits first (4 or 8 bits)."""
    raw = np.ascontiguousarray(words.numpy().astype("<i4", copy=False)).view(np.uint8)  # [R, 4C], low byte first
    if bits == 8:
        return raw
    return np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(raw.shape[0], -1)


def _scales(t: torch.Tensor, n: int, prefix: str) -> np.ndarray:
    """A scale tensor ([N, G], [N], [1] or a scalar) -> float32 [N, G]."""
    s = t.float()
    s = s.reshape(-1, 1) if s.dim() < 2 else s
    if s.shape[0] not in (1, n):
        raise CheckpointError(f"{prefix}: {tuple(t.shape)} scales for {n} output rows")
    return np.broadcast_to(s.numpy(), (n, s.shape[1])).astype(np.float32)  # a writable copy


def _check_group_order(t: Tensors, name: str, k: int, group: int) -> None:
    """A stored g_idx must say what contiguous groups mean (act-order checkpoints permute it: refused)."""
    if name in t and not np.array_equal(t.get(name).numpy(), np.arange(k) // group):
        raise CheckpointError(f"{name}: input columns are not in group order (an act-order / desc_act checkpoint); "
                              "re-quantize with desc_act false (actorder static or none)")


def _shape_error(prefix: str, what: str) -> CheckpointError:
    return CheckpointError(f"{prefix}: {what}")


def read_gptq(t: Tensors, prefix: str, bits: int, v1: bool) -> IntWeights:
    """A GPTQ layer's qweight / qzeros / scales (module docstring)."""
    qweight = t.get(f"{prefix}.qweight")
    codes = np.ascontiguousarray(unpack_int32(qweight.T.contiguous(), bits))  # [N, K]
    n, k = codes.shape
    scales = _scales(t.get(f"{prefix}.scales").T, n, prefix)  # [N, G]
    if k % scales.shape[1]:
        raise _shape_error(prefix, f"{k} input columns do not split into {scales.shape[1]} groups")
    zeros = unpack_int32(t.get(f"{prefix}.qzeros"), bits)[:, :n].T.astype(np.int16)  # [N, G]
    if v1:
        zeros = (zeros + 1) % (1 << bits)
    _check_group_order(t, f"{prefix}.g_idx", k, k // scales.shape[1])
    return IntWeights(codes, scales, np.ascontiguousarray(zeros), bits)


def read_awq(t: Tensors, prefix: str) -> IntWeights:
    """An AWQ (GEMM) layer's qweight / qzeros / scales, 4 bits (module docstring)."""

    def rows_in_order(words: torch.Tensor) -> np.ndarray:  # [R, N / 8] -> [R, N]
        v = unpack_int32(words, 4)
        return v.reshape(v.shape[0], -1, 8)[:, :, AWQ_ROW_OF_NIBBLE].reshape(v.shape[0], -1)

    codes = np.ascontiguousarray(rows_in_order(t.get(f"{prefix}.qweight")).T)  # [N, K]
    n, k = codes.shape
    scales = _scales(t.get(f"{prefix}.scales").T, n, prefix)
    if k % scales.shape[1]:
        raise _shape_error(prefix, f"{k} input columns do not split into {scales.shape[1]} groups")
    zeros = np.ascontiguousarray(rows_in_order(t.get(f"{prefix}.qzeros")).T.astype(np.int16))
    return IntWeights(codes, scales, zeros, 4)


def read_compressed_int(t: Tensors, prefix: str) -> IntWeights:
    """A compressed-tensors integer layer: pack-quantized (4 or 8 bits) or int-quantized (8 bits)."""
    if f"{prefix}.weight_packed" in t:
        n, k = (int(v) for v in t.get(f"{prefix}.weight_shape").tolist())
        packed = t.get(f"{prefix}.weight_packed")
        if packed.shape[0] != n or (packed.shape[1] * 32) % k:
            raise _shape_error(prefix, f"weight_packed {tuple(packed.shape)} does not hold a [{n}, {k}] weight")
        bits = packed.shape[1] * 32 // k
        if bits not in (4, 8):
            raise _shape_error(prefix, f"{bits}-bit codes (only 4- and 8-bit integer weights are loaded)")
        codes = np.ascontiguousarray(unpack_int32(packed, bits)[:, :k])
    else:
        q = t.get(f"{prefix}.weight")  # int8 [N, K], the signed code itself
        n, k, bits = q.shape[0], q.shape[1], 8
        codes = q.numpy().view(np.uint8) ^ 0x80  # + 128
    scales = _scales(t.get(f"{prefix}.weight_scale"), n, prefix)
    if k % scales.shape[1]:
        raise _shape_error(prefix, f"{k} input columns do not split into {scales.shape[1]} groups")
    offset = 1 << (bits - 1)
    zeros = np.full(scales.shape, offset, dtype=np.int16)
    if f"{prefix}.weight_zero_point" in t:
        zp = t.get(f"{prefix}.weight_zero_point")
        if zp.dtype == torch.int32:  # packed along the rows (pack-quantized), stored as zero + offset
            stored = unpack_int32(zp.T.contiguous(), bits)[:, :n].T.astype(np.int16)
        else:  # int8, the signed zero itself
            stored = (zp.reshape(-1, 1) if zp.dim() < 2 else zp).numpy().astype(np.int16) + offset
        zeros = np.broadcast_to(stored, scales.shape).copy()
    _check_group_order(t, f"{prefix}.weight_g_idx", k, k // scales.shape[1])
    return IntWeights(codes, scales, zeros, bits)


def read_fp8(t: Tensors, prefix: str, block: tuple[int, int] | None) -> torch.Tensor:
    """A compressed-tensors FP8 layer dequantized: float32 [N, K] = weight * its scale per tensor, row, group or
    `block` ([rows, columns] per scale, the "block" strategy)."""
    w = t.get(f"{prefix}.weight").float()
    n, k = w.shape
    s = t.get(f"{prefix}.weight_scale").float()
    s = s.reshape(1, 1) if s.numel() == 1 else s.reshape(s.shape[0], -1)
    rows, cols = block if block is not None and s.shape[0] not in (1, n) else (n // s.shape[0], k // s.shape[1])
    if -(-n // rows) != s.shape[0] or -(-k // cols) != s.shape[1]:
        raise _shape_error(prefix, f"weight_scale {tuple(s.shape)} does not tile a [{n}, {k}] weight")
    return w * s.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
