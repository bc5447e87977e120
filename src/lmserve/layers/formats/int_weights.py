"""Integer weights of pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) and their exact mapping onto the
native int8-dot kernels' layouts (layers/formats/gguf_linear.py, csrc/quant_gemm.cpp).

Every integer format the loader accepts stores w = scale * (code - zero): unsigned `bits`-bit codes, and one scale
and one zero per `group` consecutive input columns of an output row (group = K: one per row, "channel-wise").
`IntWeights` holds that in one form whatever the file's packing (loader/prequant_formats.py unpacks each format).
`kernel_blocks` maps it onto a layout the packed kernels already run, with no kernel of its own:
- 4 bits, groups of a multiple of 32: U4, the layout Q4_0/Q4_1 blocks are repacked into. Per block of 32 weights
  a float scale s and min -s * zero (a group of 128 is four blocks with the same scale and min); the codes are
  the block's nibbles. Symmetric 4-bit in groups of 32 is Q4_0 exactly (zero 8).
- 8 bits, symmetric (zero 128): S8, Q8_0's layout: the signed code - 128, and the scale once per 16 weights.
Both are exact: s * code + min = s * (code - zero) in float32 for float16/bfloat16 scales (an 11-bit significand
times at most 8 bits never rounds), within one rounding for float32 scales. Anything else (8 bits with zero
points: code - zero needs a min the S8 layout lacks; groups that are not whole blocks of 32) maps to None, and the
loader dequantizes that layer to float instead (`dequantize_int`, the plain reference for every path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lmserve.layers.formats.gguf_linear import QK, S8, U4, Repacked, _codes_to_nibbles


@dataclass
class IntWeights:
    """One weight matrix [N, K] as w = scales * (codes - zeros), per group of input columns."""

    codes: np.ndarray  # uint8 [N, K], 0 .. 2**bits - 1
    scales: np.ndarray  # float32 [N, K / group]
    zeros: np.ndarray  # int16 [N, K / group], in the codes' range (2**(bits - 1) where the file is symmetric)
    bits: int

    @property
    def group(self) -> int:
        """Input columns per scale."""
        return self.codes.shape[1] // self.scales.shape[1]


def dequantize_int(w: IntWeights) -> torch.Tensor:
    """float32 [N, K]: (code - zero) * scale, as the quantizing libraries compute it (the reference weights)."""
    n, k = w.codes.shape
    codes = torch.from_numpy(w.codes.astype(np.float32)).view(n, -1, w.group)
    zeros = torch.from_numpy(w.zeros.astype(np.float32))[..., None]
    return ((codes - zeros) * torch.from_numpy(w.scales)[..., None]).view(n, k)


def kernel_blocks(w: IntWeights) -> Repacked | None:
    """`w` in a native kernel layout (U4 or S8), exactly; None where none fits (module docstring)."""
    n, k = w.codes.shape
    if k % QK or w.group % QK:
        return None
    if w.bits == 4:
        scales = np.repeat(w.scales, w.group // QK, axis=1)  # [N, K/32]
        mins = -scales * np.repeat(w.zeros, w.group // QK, axis=1).astype(np.float32)
        return Repacked(U4, _codes_to_nibbles(w.codes.reshape(n, -1, QK)).reshape(n, -1), scales, mins)
    if w.bits == 8 and bool((w.zeros == 128).all()):
        codes = (w.codes ^ 0x80).view(np.int8)  # code - 128 in two's complement
        return Repacked(S8, codes, np.repeat(w.scales, w.group // 16, axis=1), None)
    return None
