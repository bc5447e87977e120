"""Linear layers that keep a GGUF file's quantized weights (`--quantization gguf`).

Each GGUF block type is repacked, exactly, into one of the layouts the native kernel reads
(layers/kernels/csrc/quant_gemm.cpp): 4-bit codes (U4: Q4_0, Q4_1, Q4_K), 5-bit codes a byte (U8: Q5_0, Q5_1,
Q5_K), each with a float scale and min per 32 weights; signed 8-bit codes with a float scale per 16
weights (S8: Q8_0, Q6_K); 4-bit indices into a 16-entry table of signed values, with S8's scale per 16:
IQ4_NL's non-linear table (NL4: IQ4_NL, IQ4_XS) or nibble - 8 (I4: the layout Q2_K and Q3_K had, kept as
benchmarks/lowbit_layer.py's baseline; repack no longer makes it); or the low-bit K-quants held near their
file size, their integer scales per 16 kept as the file has them under a float per superblock of 256: K2 (Q2_K:
2-bit codes, a byte per 16 with the 4-bit scale and min, d and -dmin; 0.34 bytes a weight against the file's
0.33) and K3 (Q3_K: the 2-bit low plane, a 1-bit high plane, a signed 6-bit scale per 16 in a byte, d; 0.45
against 0.43). Repacking turns the other types' per-superblock scales into plain floats (d * sc, -dmin * m);
the kernel forms K2/K3's the same way in registers: the dequantized weights are the same numbers ggml computes.

MXFP4 (gpt-oss's experts: 32 E2M1 values under one E8M0 exponent) is held as S8: each value doubled is an integer
in -12..12 (ggml's kvalues) and the exponent byte becomes the float 2 ** (e - 128) of both halves, so the weights
are exact and run on Q8_0's paths, at 1.25 bytes a weight against the file's 0.53 (a fifth table kind, 4-bit codes
into the E2M1 values beside NL4's, would hold them at 0.75: left).

The reference path (`reference_linear`) dequantizes and runs a float matmul with the activations
quantized exactly as the kernel does; tests compare the two for every type on odd shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from lmserve.layers.kernels.native import native_module

U4, U8, S8, NL4, I4, K2, K3 = 0, 1, 2, 3, 4, 5, 6  # kernel layouts (quant_gemm.cpp `kind`)
# the signed value of each 4-bit index of the table kinds (quant_gemm.cpp kTables)
TABLES = {NL4: np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8),
          I4: np.arange(-8, 8, dtype=np.int8)}
NIBBLES = (U4, NL4, I4)  # codes two a byte in ggml's nibble order
PER16 = (S8, NL4, I4)  # a scale (and min) per 16 weights
SUPER = (K2, K3)  # an integer scale per 16 in the codes, a float scale (K2: and min) per 256 weights
# a K2/K3 block of 32 weights in the row layout: code bytes (2-bit plane; K3: then 1-bit plane), then 2 scale bytes
SUPER_BLOCK_BYTES = {K2: 8 + 2, K3: 8 + 4 + 2}
QK = 32  # weights per block of the simple types and per sub-block of Q4_K/Q5_K
QK_K = 256  # weights per K-quant superblock


@dataclass
class Repacked:
    """One weight matrix [N, K] in a kernel layout (numpy until the layer is built)."""

    kind: int
    codes: np.ndarray  # U4, NL4, I4: uint8 [N, K/2]; U8: uint8 [N, K]; S8: int8 [N, K]; K2, K3: uint8 [N, K/32 * 10 or 14]
    scales: np.ndarray  # float32 [N, K/32] (U4, U8), [N, K/16] (S8, NL4, I4) or [N, K/256] (K2, K3: d)
    mins: np.ndarray | None  # float32 like scales (U4, U8; K2: -dmin); else None

    @property
    def layout(self) -> tuple[int, bool]:
        """What matrices must share to be stacked: the kind, and whether it has mins."""
        return self.kind, self.mins is None

    @property
    def in_features(self) -> int:
        """K, the weights per row, in either layout."""
        per_scale = 256 if self.kind in SUPER else 16 if self.kind in PER16 else QK
        return self.scales.shape[-2 if is_packed(self) else 1] * per_scale

    def rows(self, index: np.ndarray) -> "Repacked":
        """The same weights with output rows reordered/selected (q/k row permutation, fused shards)."""
        return Repacked(self.kind, self.codes[index], self.scales[index], None if self.mins is None else self.mins[index])


def concat(parts: list[Repacked]) -> Repacked:
    """Stack matrices of one layout along the output rows (fused qkv and gate_up)."""
    if len({p.layout for p in parts}) != 1:
        raise ValueError("fused parts must share a quantization layout")
    mins = None if parts[0].mins is None else np.concatenate([p.mins for p in parts])
    return Repacked(parts[0].kind, np.concatenate([p.codes for p in parts]),
                    np.concatenate([p.scales for p in parts]), mins)


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """Little-endian float16 at byte `start` of every block -> float32 [..., 1]."""
    return raw[..., start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles_to_codes(qs: np.ndarray) -> np.ndarray:
    """ggml's 16-byte nibble block [..., 16] -> 32 codes [..., 32] (low nibbles first, then high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _codes_to_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., 32] codes 0..15 -> ggml's nibble block [..., 16] (the U4 layout)."""
    return (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4-byte qh [..., 4] -> bit j of the little-endian word for j in 0..31 [..., 32]."""
    word = qh.copy().view("<u4")  # [..., 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _simple(raw: np.ndarray, n: int, k: int, kind: str) -> Repacked:
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks of 32 with a float16 scale (and min)."""
    b = raw.reshape(n, k // QK, -1)
    d = _f16(b, 0)[..., 0]
    if kind == "Q8_0":
        codes = b[..., 2:34].copy().view(np.int8).reshape(n, k)
        return Repacked(S8, codes, np.repeat(d, 2, axis=1), None)
    has_min = kind in ("Q4_1", "Q5_1")
    m = _f16(b, 2)[..., 0] if has_min else None
    off = 4 if has_min else 2
    if kind.startswith("Q4"):
        qs = b[..., off:off + 16]
        return Repacked(U4, qs.reshape(n, -1).copy(), d, m if has_min else -8.0 * d)
    hi = _high_bits(b[..., off:off + 4])
    codes = _nibbles_to_codes(b[..., off + 4:off + 20]) | (hi << 4)
    return Repacked(U8, codes.reshape(n, k), d, m if has_min else -16.0 * d)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes [..., 12] -> 6-bit scales and mins of the 8 sub-blocks, each [..., 8]."""
    q = scales.astype(np.uint8)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_quant_4_5(raw: np.ndarray, n: int, k: int, kind: str) -> Repacked:
    """Q4_K / Q5_K: superblocks of 256 = 8 sub-blocks of 32 with 6-bit scales and mins under f16 d, dmin."""
    b = raw.reshape(n, k // QK_K, -1)
    d, dmin = _f16(b, 0), _f16(b, 2)  # [n, S, 1]
    sc, mn = _k_scales(b[..., 4:16])
    five = kind == "Q5_K"
    qs = b[..., 48:176] if five else b[..., 16:144]  # 128 bytes: 4 chunks of 32, each = 2 sub-blocks
    chunks = qs.reshape(n, -1, 4, 32)
    codes = np.stack([chunks & 0x0F, chunks >> 4], axis=3).reshape(n, -1, 8, 32)  # sub-block 2j, 2j+1
    if five:
        qh = b[..., 16:48]  # [n, S, 32]: bit s of byte l is the high bit of sub-block s, element l
        bits = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n, S, 8, 32]
        codes = codes | (bits << 4)
    scales, mins = (d * sc).reshape(n, -1), (-dmin * mn).reshape(n, -1)
    if five:
        return Repacked(U8, codes.reshape(n, k).astype(np.uint8), scales, mins)
    return Repacked(U4, _codes_to_nibbles(codes).reshape(n, -1), scales, mins)


def _q6_k(raw: np.ndarray, n: int, k: int) -> Repacked:
    """Q6_K: superblocks of 256 = 16 groups of 16 with int8 scales under an f16 d; codes 6-bit, minus 32."""
    b = raw.reshape(n, k // QK_K, -1)
    ql = b[..., 0:128].reshape(n, -1, 2, 64)
    qh = b[..., 128:192].reshape(n, -1, 2, 32)
    sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [n, S, 16]
    d = _f16(b, 208)
    lo = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)  # [n, S, 2, 128]
    codes = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)
    return Repacked(S8, codes.reshape(n, k), (d * sc).reshape(n, -1), None)


def _super_rows(crumbs: np.ndarray, high: np.ndarray | None, sc: np.ndarray) -> np.ndarray:
    """K2/K3 fields -> the row layout [N, K/32 * bytes]: per block of 32, byte j holds elements j, 8 + j, 16 + j,
    24 + j in its bit pairs 0, 2, 4, 6; (K3) 4 bytes whose little-endian bit e is element e's high bit; 2 scale bytes.
    `crumbs`, `high`: uint8 [N, K] (element order); `sc`: uint8 [N, K/16]."""
    n, k = crumbs.shape
    c = crumbs.reshape(n, k // QK, 4, 8)
    parts = [(c[:, :, 0] | (c[:, :, 1] << 2) | (c[:, :, 2] << 4) | (c[:, :, 3] << 6)).astype(np.uint8)]
    if high is not None:
        parts.append(np.packbits(high.reshape(n, k // QK, QK), axis=-1, bitorder="little"))
    parts.append(sc.reshape(n, k // QK, 2))
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _super_fields(w: "Repacked") -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The row layout of K2/K3 -> (crumbs [N, K], high bits [N, K] or None, scale bytes [N, K/16])."""
    n = w.codes.shape[0]
    b = w.codes.reshape(n, -1, SUPER_BLOCK_BYTES[w.kind])
    crumbs = (b[..., None, :8] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [n, nb, 4, 8]
    high = np.unpackbits(b[..., 8:12], axis=-1, bitorder="little").reshape(n, -1) if w.kind == K3 else None
    return crumbs.reshape(n, -1), high, b[..., -2:].reshape(n, -1)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 64 bytes of 2-bit codes [n, S, 64] -> [n, K] in element order: element 128 h + 32 j + l is bits
    2j of byte 32 h + l."""
    q = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    return ((q >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(qs.shape[0], -1)


def _q2_k(raw: np.ndarray, n: int, k: int) -> Repacked:
    """Q2_K: superblocks of 256 = 16 groups of 16 with 4-bit scales and mins under f16 d, dmin; codes 0..3."""
    b = raw.reshape(n, k // QK_K, -1)
    sc = b[..., 0:16]  # low nibble the scale, high nibble the min of each group of 16: kept as they are
    d, dmin = _f16(b, 80), _f16(b, 82)
    return Repacked(K2, _super_rows(_crumbs(b[..., 16:80]), None, sc.reshape(n, -1)), d[..., 0], -dmin[..., 0])


def _q3_k(raw: np.ndarray, n: int, k: int) -> Repacked:
    """Q3_K: superblocks of 256 = 16 groups of 16 with 6-bit scales (minus 32) under an f16 d; codes 3-bit, minus
    4 where the high bit (hmask) is clear: held as the low crumb, the high bit and the signed scale byte."""
    b = raw.reshape(n, k // QK_K, -1)
    hmask, s, d = b[..., 0:32], b[..., 96:108], _f16(b, 108)
    high = (hmask[..., None, None, :] >> np.arange(8, dtype=np.uint8).reshape(2, 4, 1)) & 1  # [n, S, 2, 4, 32]
    low4 = np.concatenate([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], axis=-1)
    high2 = np.concatenate([(s[..., 8:12] >> (2 * g)) & 3 for g in range(4)], axis=-1)
    sc = ((low4 | (high2 << 4)).astype(np.int16) - 32).astype(np.int8).view(np.uint8)  # [n, S, 16]
    return Repacked(K3, _super_rows(_crumbs(b[..., 32:96]), high.reshape(n, -1), sc.reshape(n, -1)), d[..., 0], None)


def _super_weights(w: Repacked) -> np.ndarray:
    """float32 [N, K] of a K2/K3 matrix in the row layout, formed as ggml does: (d * sc) * q (- dmin * m)."""
    crumbs, high, sc = _super_fields(w)
    n, k = crumbs.shape
    d = np.repeat(w.scales, 16, axis=1)  # per 16
    if w.kind == K2:
        q = crumbs.astype(np.float32).reshape(n, -1, 16)
        mins = np.repeat(w.mins, 16, axis=1) * (sc >> 4).astype(np.float32)
        return (q * (d * (sc & 0x0F).astype(np.float32))[..., None] + mins[..., None]).reshape(n, k)
    q = (crumbs.astype(np.int8) + 4 * high.astype(np.int8) - 4).astype(np.float32).reshape(n, -1, 16)
    return (q * (d * sc.view(np.int8).astype(np.float32))[..., None]).reshape(n, k)


def _iq4(raw: np.ndarray, n: int, k: int, kind: str) -> Repacked:
    """IQ4_NL (blocks of 32 under an f16 d) and IQ4_XS (superblocks of 256 = 8 blocks of 32 with 6-bit scales,
    minus 32, under an f16 d): nibble indices into the non-linear table, already in the U4 byte order."""
    if kind == "IQ4_NL":
        b = raw.reshape(n, k // QK, -1)
        return Repacked(NL4, b[..., 2:18].reshape(n, -1).copy(), np.repeat(_f16(b, 0)[..., 0], 2, axis=1), None)
    b = raw.reshape(n, k // QK_K, -1)
    high = (b[..., 2:4].copy().view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, S, 8]
    low = np.stack([b[..., 4:8] & 0x0F, b[..., 4:8] >> 4], axis=-1).reshape(n, -1, 8)
    scales = _f16(b, 0) * ((low | (high << 4)).astype(np.float32) - 32)  # [n, S, 8], one per 32
    return Repacked(NL4, b[..., 8:136].reshape(n, -1).copy(), np.repeat(scales.reshape(n, -1), 2, axis=1), None)


MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)  # E2M1 doubled


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 exponent bytes -> 2 ** (e - 128) as float32 (ggml's ggml_e8m0_to_fp32_half: subnormal below e = 2)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


def _mxfp4(raw: np.ndarray, n: int, k: int) -> Repacked:
    """MXFP4: blocks of 32 = an E8M0 exponent byte, then 16 bytes of E2M1 codes in ggml's nibble order -> S8 (the
    doubled values as codes, 2 ** (e - 128) per 16)."""
    b = raw.reshape(n, k // QK, -1)
    codes = MXFP4_VALUES[_nibbles_to_codes(b[..., 1:17])]  # [n, K/32, 32]
    return Repacked(S8, codes.reshape(n, k), np.repeat(e8m0_half(b[..., 0]), 2, axis=1), None)


BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q2_K": 84, "Q3_K": 110, "Q4_K": 144,
               "Q5_K": 176, "Q6_K": 210, "IQ4_NL": 18, "IQ4_XS": 136, "MXFP4": 17}


def repack(kind: str, raw: np.ndarray, n: int, k: int) -> Repacked:
    """A GGUF tensor's raw blocks (uint8, N rows of K weights) -> a kernel layout, exactly."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {kind} cannot be kept quantized (supported: {', '.join(BLOCK_BYTES)})")
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1)
    if kind in ("Q4_K", "Q5_K"):
        return _k_quant_4_5(raw, n, k, kind)
    if kind == "Q6_K":
        return _q6_k(raw, n, k)
    if kind == "Q3_K":
        return _q3_k(raw, n, k)
    if kind == "Q2_K":
        return _q2_k(raw, n, k)
    if kind.startswith("IQ4"):
        return _iq4(raw, n, k, kind)
    if kind == "MXFP4":
        return _mxfp4(raw, n, k)
    return _simple(raw, n, k, kind)


GROUP = 16  # output rows per group of the kernel's packed layout (quant_gemm.cpp: every x86-64 level's build)


def _chunks(kind: int) -> int:
    """4-byte columns per block in a packed group: nibble bytes pair elements j and 16 + j."""
    return 4 if kind in NIBBLES else 8


def _lanes(a: np.ndarray) -> np.ndarray:
    """[N, X] per-row values -> [N/16, X, 16]: row 16 g + i's value in lane i of group g."""
    return np.ascontiguousarray(a.reshape(a.shape[0] // GROUP, GROUP, -1).transpose(0, 2, 1), dtype=np.float32)


def _rows(a: np.ndarray) -> np.ndarray:
    """`_lanes` undone."""
    return np.ascontiguousarray(a.transpose(0, 2, 1)).reshape(a.shape[0] * GROUP, -1)


def _pack_super(w: Repacked) -> Repacked:
    """K2/K3 in the packed layout: per group of 16 rows and block of 32, two 64-byte vectors of crumbs (byte 4 i + q
    of vector h holds row i's elements 16 h + 4 s + q in its bit pairs s), (K3) 64 bytes of high bits (bit 4 h + s
    of byte 4 i + q, the same elements), then the 16 rows' scale bytes of the first half, then of the second."""
    crumbs, high, sc = _super_fields(w)
    n, k = crumbs.shape
    g, nb = n // GROUP, k // QK
    c = crumbs.reshape(g, GROUP, nb, 2, 4, 4).transpose(0, 2, 3, 4, 1, 5)  # [g, nb, h, s, i, q]
    parts = [sum(c[:, :, :, s] << (2 * s) for s in range(4)).astype(np.uint8).reshape(g, nb, 128)]
    if high is not None:
        hb = high.reshape(g, GROUP, nb, 8, 4).transpose(0, 2, 3, 1, 4)  # [g, nb, 4 h + s, i, q]
        parts.append(sum(hb[:, :, t] << t for t in range(8)).astype(np.uint8).reshape(g, nb, 64))
    parts.append(sc.reshape(g, GROUP, nb, 2).transpose(0, 2, 3, 1).reshape(g, nb, 32))
    mins = None if w.mins is None else _lanes(w.mins)
    return Repacked(w.kind, np.ascontiguousarray(np.concatenate(parts, axis=-1)), _lanes(w.scales), mins)


def _unpack_super(w: Repacked) -> Repacked:
    """`_pack_super` undone."""
    g, nb, _ = w.codes.shape
    n = g * GROUP
    shifts = np.arange(4, dtype=np.uint8)
    c = (w.codes[..., :128].reshape(g, nb, 2, 1, GROUP, 4) >> (2 * shifts)[:, None, None]) & 3  # [g, nb, h, s, i, q]
    crumbs = c.transpose(0, 4, 1, 2, 3, 5).reshape(n, -1)
    high = None
    if w.kind == K3:
        t = (w.codes[..., 128:192].reshape(g, nb, 1, GROUP, 4) >> np.arange(8, dtype=np.uint8)[:, None, None]) & 1
        high = t.transpose(0, 3, 1, 2, 4).reshape(n, -1)
    sc = w.codes[..., -32:].reshape(g, nb, 2, GROUP).transpose(0, 3, 1, 2).reshape(n, -1)
    mins = None if w.mins is None else _rows(w.mins)
    return Repacked(w.kind, _super_rows(crumbs, high, sc), _rows(w.scales), mins)


def pack(w: Repacked) -> Repacked:
    """The row layout -> the packed layout quant_gemm.cpp reads on every x86-64 level (N a multiple of 16): per group of
    16 rows and block, 4-byte columns of the 16 rows side by side; scales and mins [N/16, blocks, 16]; S8 codes
    as unsigned bytes (code + 128); K2/K3 as `_pack_super` says. Only a regrouping of the same bytes (and S8's sign
    flip): `unpack` inverts it."""
    if w.kind in SUPER:
        return _pack_super(w)
    n = w.codes.shape[0]
    g, cols = n // GROUP, _chunks(w.kind)
    # moved as 4-byte words (4x fewer elements for numpy's transposing copy: ~0.1 s less of every start)
    words = np.ascontiguousarray(w.codes).view(np.uint32).reshape(g, GROUP, -1, cols).transpose(0, 2, 3, 1)
    codes = np.ascontiguousarray(words).view(np.uint8).reshape(g, words.shape[1], -1)
    if w.kind == S8:
        codes ^= 0x80  # a fresh array (the transposing copy)
    return Repacked(w.kind, codes, _lanes(w.scales), None if w.mins is None else _lanes(w.mins))


def unpack(w: Repacked) -> Repacked:
    """The packed layout -> the row layout (exactly the Repacked that `pack` was given)."""
    if w.kind in SUPER:
        return _unpack_super(w)
    g, nb = w.codes.shape[:2]
    words = np.ascontiguousarray(w.codes).view(np.uint32).reshape(g, nb, _chunks(w.kind), GROUP)
    codes = np.ascontiguousarray(words.transpose(0, 3, 1, 2)).view(np.uint8).reshape(g * GROUP, -1)
    if w.kind == S8:
        codes = (codes ^ 0x80).view(np.int8)
    return Repacked(w.kind, codes, _rows(w.scales), None if w.mins is None else _rows(w.mins))


def is_packed(w: Repacked) -> bool:
    return w.codes.ndim == 3


def out_rows(w: Repacked) -> int:
    """N, the matrix's output rows, in either layout."""
    return w.codes.shape[0] * (GROUP if is_packed(w) else 1)


def kernel_layout(w: Repacked) -> Repacked:
    """`w` in the layout this machine's kernel reads: packed where the build has it (every x86-64 level's;
    not a plain host build without SSSE3) and N is a multiple of 16, else the row layout."""
    if is_packed(w):
        return w
    mod = native_module()
    return pack(w) if mod is not None and mod.quant_packed_rows() == GROUP and out_rows(w) % GROUP == 0 else w


def dequantize(w: Repacked) -> torch.Tensor:
    """float32 [N, K] weights of a repacked matrix in the row layout (the reference path's weights)."""
    if w.kind in SUPER:
        return torch.from_numpy(_super_weights(w))
    if w.kind in TABLES:
        n = w.codes.shape[0]
        idx = _nibbles_to_codes(w.codes.reshape(n, -1, 16)).reshape(n, -1)
        values = torch.from_numpy(TABLES[w.kind][idx].astype(np.float32)).view(n, -1, 16)
        out = values * torch.from_numpy(w.scales)[..., None]
        return (out if w.mins is None else out + torch.from_numpy(w.mins)[..., None]).view(n, -1)
    if w.kind == S8:
        codes = torch.from_numpy(w.codes.astype(np.float32))
        return (codes.view(codes.shape[0], -1, 16) * torch.from_numpy(w.scales)[..., None]).view(codes.shape)
    codes = w.codes
    if w.kind == U4:
        codes = _nibbles_to_codes(codes.reshape(codes.shape[0], -1, 16)).reshape(codes.shape[0], -1)
    c = torch.from_numpy(codes.astype(np.float32)).view(codes.shape[0], -1, QK)
    out = c * torch.from_numpy(w.scales)[..., None] + torch.from_numpy(w.mins)[..., None]
    return out.view(codes.shape[0], -1)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes as float [M, K], scales [M, K/32]) exactly as quant_gemm.cpp rounds them."""
    b = x.float().view(x.shape[0], -1, QK)
    amax = b.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127.0
    inv = torch.where(amax > 0, 1.0 / scale, torch.zeros_like(scale))
    return torch.round(b * inv).view(x.shape), scale.view(x.shape[0], -1)


def reference_linear(x: torch.Tensor, w: Repacked, bias: torch.Tensor | None) -> torch.Tensor:
    """Dequantize-then-matmul with the kernel's int8 activations, in float64 (the parity reference)."""
    q, s = quantize_activations(x)
    xd = (q.view(q.shape[0], -1, QK) * s[..., None]).view(q.shape).double()
    y = xd @ dequantize(w).double().T
    return (y if bias is None else y + bias.double()).float()


class GGUFLinear(nn.Module):
    """y = x W^T + b with W in a GGUF file's codes (CPU, float32 activations)."""

    def __init__(self, w: Repacked, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        # the kernel's packed layout where the build has it (~3x the row layout's speed on AVX-512 VNNI; on AVX2 a
        # 16-row step reuses each unpacked weight for 4 rows: benchmarks/packed_layout.py)
        w = kernel_layout(w)
        self.kind, self.in_features, self.out_features, self.packed = w.kind, in_features, out_rows(w), is_packed(w)
        self.register_buffer("codes", torch.from_numpy(np.ascontiguousarray(w.codes)))
        self.register_buffer("scales", torch.from_numpy(np.ascontiguousarray(w.scales, dtype=np.float32)))
        mins = None if w.mins is None else torch.from_numpy(np.ascontiguousarray(w.mins, dtype=np.float32))
        self.register_buffer("mins", mins)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def repacked(self) -> Repacked:
        """The weights in the row layout (unpacked if the kernel reads them packed)."""
        mins = None if self.mins is None else self.mins.numpy()
        w = Repacked(self.kind, self.codes.numpy(), self.scales.numpy(), mins)
        return unpack(w) if self.packed else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        mod = native_module()
        if mod is not None:
            y = mod.quant_linear(x2, self.codes, self.scales, self.mins, self.kind, self.bias)
        else:  # no compiler: the reference path (slow, same numbers up to summation order)
            y = reference_linear(x2, self.repacked(), self.bias)
        return y.view(*shape[:-1], self.out_features)


class FusedGGUFLinear(nn.Module):
    """A fused projection (qkv, gate_up) whose parts a GGUF file keeps in different kernel layouts, as Q4_K_M files
    do (v in Q6_K or Q8_0 beside Q4_K or Q5_0 q and k): one GGUFLinear per run of parts in one layout, outputs side
    by side, then the fused bias. Each part's rows are computed exactly as a GGUFLinear alone would."""

    def __init__(self, parts: list[GGUFLinear], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)  # [..., out_features]
        return y if self.bias is None else y + self.bias
