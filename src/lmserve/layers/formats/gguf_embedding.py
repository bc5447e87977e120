"""An embedding table kept in a GGUF file's quantized blocks: only the looked-up rows are dequantized.

The table is one of layers/formats/gguf_linear.py's repacked layouts (the embedded model's Q8_0 `token_embd` is S8).
A row is dequantized as ggml does it: code * scale (+ min) in float32, where the repacked scale and min are
the products ggml forms first (d * sc, -dmin * m), so a looked-up row equals the same row of the `gguf`
package's dequantized table bit for bit. A tied LM head is a GGUFLinear over the same tensors
(`share_blocks`), so the table is held once: 35 MiB for SmolLM2-135M's Q8_0 table instead of 108 MiB of float32
for the embedding plus 35 MiB for the head. Where the tied head's kernel reads the packed layout (16 rows
interleaved per block), the loader hands the table over packed, and a lookup gathers each row's bytes back
out of its group.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from lmserve.layers.formats.gguf_linear import (
    GROUP,
    NIBBLES,
    PER16,
    QK,
    S8,
    SUPER,
    TABLES,
    U4,
    U8,
    GGUFLinear,
    Repacked,
    dequantize,
    is_packed,
    out_rows,
    unpack,
)
from lmserve.layers.kernels.native import native_module

NATIVE_ROWS = (U4, U8, S8)  # the packed kinds whose lookup runs natively (the others: _rows, then dequantize_rows)


def dequantize_rows(kind: int, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """Rows of one layout (codes [T, ...], scales and mins [T, blocks]) -> float32 weights [T, K]."""
    t = codes.shape[0]
    if kind in NIBBLES:  # 16 bytes per block of 32: low nibbles are weights 0..15, high nibbles 16..31
        b = codes.view(t, -1, QK // 2)
        codes = torch.cat([b & 0x0F, b >> 4], dim=-1)
    if kind in TABLES:  # each code's signed value
        codes = torch.from_numpy(TABLES[kind])[codes.long()]
    if kind in PER16:  # one scale (and, for Q2_K's I4, one min) per 16
        rows = codes.reshape(t, -1, 16).float() * scales[..., None]
        return (rows if mins is None else rows + mins[..., None]).view(t, -1)
    c = codes.reshape(t, -1, QK).float()
    # two roundings (product, then sum) as numpy does in the gguf package: no fused multiply-add
    return (c * scales[..., None] + mins[..., None]).view(t, -1)


class GGUFEmbedding(nn.Module):
    """Token ids -> rows of a quantized table, dequantized on lookup (CPU)."""

    def __init__(self, w: Repacked, dtype: torch.dtype = torch.float32) -> None:
        """`w` in the row layout, or packed (gguf_linear.kernel_layout) for a table a tied head reads."""
        super().__init__()
        self.kind, self.dtype, self.packed = w.kind, dtype, is_packed(w)
        self.num_embeddings = out_rows(w)
        self.embedding_dim = w.in_features
        # from_numpy shares the arrays: a GGUFLinear built from the same Repacked shares these tensors
        self.register_buffer("codes", torch.from_numpy(np.ascontiguousarray(w.codes)))
        self.register_buffer("scales", torch.from_numpy(np.ascontiguousarray(w.scales, dtype=np.float32)))
        mins = None if w.mins is None else torch.from_numpy(np.ascontiguousarray(w.mins, dtype=np.float32))
        self.register_buffer("mins", mins)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if self.kind in SUPER:  # K2/K3: the rows' bit planes and scale bytes through gguf_linear.dequantize
            rows = dequantize(self._super_rows(ids))
            return rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim)
        mod = native_module() if self.packed and self.kind in NATIVE_ROWS and ids.device.type == "cpu" else None
        if mod is not None:  # the same rows in one native call (quant_gemm.cpp packed_table_rows: why there)
            rows = mod.packed_table_rows(self.codes, self.scales, self.mins, ids.long(), self.kind)
        else:
            codes, scales, mins = self._rows(ids) if self.packed else (
                self.codes[ids], self.scales[ids], None if self.mins is None else self.mins[ids])
            rows = dequantize_rows(self.kind, codes, scales, mins)
        return rows.to(self.dtype).view(*input_ids.shape, self.embedding_dim)

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows `ids` of the packed table in the row layout (gguf_linear.pack's regrouping, undone for them)."""
        group, lane = ids // GROUP, ids % GROUP
        g, nb = self.codes.shape[:2]
        # A block's bytes are 4-byte runs, one per lane in turn: gathered as int32 words, the same bytes, 4x fewer
        # elements for the index kernel (16 rows 0.13 -> 0.03 ms with the table in cache, 1,024 rows 8.5-15 -> 0.8-1.2
        # ms). The reference of the native lookup (U4, U8, S8), and the path of the other kinds.
        words = self.codes.view(torch.int32).view(g, nb, -1, GROUP)[group, :, :, lane]
        codes = words.reshape(len(ids), -1).view(torch.uint8)
        if self.kind == S8:
            codes = (codes ^ 0x80).view(torch.int8)
        mins = None if self.mins is None else self.mins[group, :, lane]
        return codes, self.scales[group, :, lane], mins

    def _super_rows(self, ids: torch.Tensor) -> Repacked:
        """Rows `ids` of a K2/K3 table in the row layout (from a packed table: their groups unpacked, then picked)."""
        mins = self.mins
        if not self.packed:
            return Repacked(self.kind, self.codes[ids].numpy(), self.scales[ids].numpy(),
                            None if mins is None else mins[ids].numpy())
        group = ids // GROUP
        w = unpack(Repacked(self.kind, self.codes[group].numpy(), self.scales[group].numpy(),
                            None if mins is None else mins[group].numpy()))
        pick = (torch.arange(len(ids)) * GROUP + ids % GROUP).numpy()  # row t of group t: lane ids[t] % 16
        return w.rows(pick)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.kind}"


def share_blocks(table: GGUFEmbedding) -> GGUFLinear:
    """A tied LM head over the embedding's own tensors (no second copy of the blocks)."""
    mins = None if table.mins is None else table.mins.numpy()
    w = Repacked(table.kind, table.codes.numpy(), table.scales.numpy(), mins)
    return GGUFLinear(w, table.embedding_dim, None)
