"""An unquantized LM head and token table held in their checkpoint's half dtype (bfloat16 / float16), float32 math.

GPTQ, AWQ and llm-compressor leave the LM head unquantized, stored in the model's own half dtype. Widened to
float32 it is the largest weight a decode step reads (SmolLM2-135M: 49152 x 576, 113 MB against ~50 MB for all
its 4-bit layers). `HalfLinear` keeps it as the checkpoint stores it, in the skinny kernel's panels
(layers/kernels/csrc/gemv.cpp widens each weight exactly as it reads it, float32 activations and sums): lossless against
the checkpoint, half the bytes. Every row count runs that one kernel (a whole prefill's rows too), so a row's
logits never depend on its batch; they are bit for bit the float32 skinny kernel's over the upcast weights.
`HalfEmbedding` looks rows up in the same panels where the head is tied (the table held once) or in its own rows.

A bfloat16 head is held coded in 12 bits a weight where that pays (`code_panels`, decided at load per matrix;
layers/kernels/csrc/coded_half.cpp): in each panel of 16 rows a weight is a 4-bit index into the panel's 16 commonest high
bytes (sign and 7 exponent bits) plus its raw low byte, and the few weights whose high byte is not among them
(~1e-4 of a trained or random-normal matrix) are kept whole in a per-panel exception list. Lossless (`half_rows`
gives the checkpoint's rows back bit for bit) and the same FMA chains as the plain panels, so the logits are bit for
bit the plain half kernel's; 0.75x the bytes (SmolLM2-135M's head: 56.6 -> 42.5 MB a token). A float16 head keeps
the plain panels: its high byte holds 2 mantissa bits, and 16 values leave ~40% of a random-normal matrix out.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from lmserve.layers.formats.linear import PANEL, to_panels
from lmserve.layers.kernels.native import native_module

HALF_DTYPES = (torch.bfloat16, torch.float16)
GROUP = 4  # inputs per coded group: 64 weights of a panel, 96 bytes (layers/kernels/csrc/coded_half.cpp)
CODED_PAYS = 0.85  # code a matrix only where it reads at most this share of its plain panels' bytes


class CodedPanels(NamedTuple):
    """A bfloat16 matrix's panels in 12 bits a weight (the layout: layers/kernels/csrc/coded_half.cpp)."""

    codes: torch.Tensor  # [P, G, 96] uint8: per group of 4 inputs, 32 bytes of 4-bit indices, then 64 low bytes
    high_bytes: torch.Tensor  # [P, 16] uint8: each panel's table
    exc_off: torch.Tensor  # [P + 1] int64: panel p's exceptions are [exc_off[p], exc_off[p + 1])
    exc_pos: torch.Tensor  # [E] int32: k * 16 + column, ascending within a panel
    exc_val: torch.Tensor  # [E] float32: the exact weights

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self)


def _positions(c: torch.Tensor) -> torch.Tensor:
    """Column(s) c -> [..., 4] byte positions of inputs v = k % 4 in a coded group (the kernel's unpack order):
    16 (c / 4) + 8 (v / 2) + 2 (c % 4) + v % 2."""
    v = torch.arange(GROUP)
    return (16 * (c // 4) + 2 * (c % 4)).unsqueeze(-1) + 8 * (v // 2) + v % 2


def code_panels(panels: torch.Tensor) -> CodedPanels | None:
    """bfloat16 panels [P, K, 16] -> their 12-bit coding, or None where it does not pay (CODED_PAYS) or the dtype
    is not bfloat16. The native coder (layers/kernels/csrc/coded_half.cpp: ~0.1 s for a 49152 x 576 head) gives the
    reference's bytes; without the kernels the reference codes (~1.5 s there, load time only)."""
    if panels.dtype != torch.bfloat16:
        return None
    mod = native_module()
    coded = CodedPanels(*mod.code_half_panels(panels.contiguous())) if mod is not None else \
        code_panels_reference(panels)
    return coded if coded.nbytes <= CODED_PAYS * panels.nbytes else None


def code_panels_reference(panels: torch.Tensor) -> CodedPanels:
    """The coding in tensor ops: each panel's 16 commonest high bytes (more weights first, then the smaller byte),
    every weight's index and low byte in the kernel's order, the others listed exactly."""
    p, k, _ = panels.shape
    g = -(-k // GROUP)
    bits = panels.view(torch.int16).to(torch.int32) & 0xFFFF  # [P, K, 16]
    high = bits >> 8
    counts = torch.zeros(p, 256, dtype=torch.int64).scatter_add_(1, high.view(p, -1).long(),
                                                                  torch.ones(p, k * PANEL, dtype=torch.int64))
    # a unique key per byte (count, then the smaller byte first): the table does not hang on topk's order of ties
    table = (counts * 256 + 255 - torch.arange(256)).topk(16, dim=1).indices  # [P, 16]
    lut = torch.full((p, 256), -1, dtype=torch.int32).scatter_(1, table, torch.arange(16, dtype=torch.int32).expand(p, 16))
    idx = lut.gather(1, high.view(p, -1)).view(p, k, 16)
    missing = idx < 0
    exc = missing.nonzero()  # [E, 3] (panel, k, column), in order: ascending k * 16 + column within a panel
    coded = CodedPanels(torch.empty(p, g, 96, dtype=torch.uint8), table.to(torch.uint8),
                        F.pad(torch.bincount(exc[:, 0], minlength=p).cumsum(0), (1, 0)),
                        (exc[:, 1] * PANEL + exc[:, 2]).to(torch.int32), panels[missing].float())
    idx = F.pad(idx.masked_fill(missing, 0), (0, 0, 0, g * GROUP - k))  # [P, G * 4, 16]; padded inputs: index 0
    low = F.pad((bits & 0xFF).masked_fill(missing, 0), (0, 0, 0, g * GROUP - k))

    def order(t: torch.Tensor) -> torch.Tensor:  # [P, G * 4, 16] -> [P, G, 64] in _positions' order
        # [P, G, v/2, v%2, c/4, c%4] -> [P, G, c/4, v/2, c%4, v%2]
        return t.view(p, g, 2, 2, 4, 4).permute(0, 1, 4, 2, 5, 3).reshape(p, g, 64)

    idx, low = order(idx), order(low)
    coded.codes.copy_(torch.cat([idx[..., :32] | (idx[..., 32:] << 4), low], dim=2))
    return coded


def coded_rows(coded: CodedPanels, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` [T] of a coded matrix, [T, K] bfloat16, exactly the checkpoint's (embedding look-ups, reference)."""
    panel, col = ids // PANEL, ids % PANEL
    g = coded.codes.shape[1]
    q = _positions(col).unsqueeze(1)  # [T, 1, 4]
    base = (panel.unsqueeze(1) * g + torch.arange(g)).unsqueeze(2) * 96  # [T, G, 1]
    flat = coded.codes.view(-1)
    nib = flat[base + q % 32].to(torch.int32)
    nib = torch.where(q < 32, nib & 15, nib >> 4).view(len(ids), -1).long()  # [T, G * 4]
    high = coded.high_bytes[panel].to(torch.int32).gather(1, nib)
    word = (high << 8 | flat[base + 32 + q].to(torch.int32).view(len(ids), -1))[:, :k]
    rows = (word - ((word >> 15) << 16)).to(torch.int16).view(torch.bfloat16)  # [T, K]
    # the exceptions of each id's panel, kept where their column is the id's
    first, count = coded.exc_off[panel], coded.exc_off[panel + 1] - coded.exc_off[panel]
    tok = torch.repeat_interleave(torch.arange(len(ids)), count)
    j = torch.arange(len(tok)) - torch.repeat_interleave(count.cumsum(0) - count - first, count)
    pos = coded.exc_pos[j].long()
    keep = pos % PANEL == col[tok]
    rows[tok[keep], pos[keep] // PANEL] = coded.exc_val[j[keep]].to(torch.bfloat16)
    return rows


def panel_rows(panels: torch.Tensor, n: int) -> torch.Tensor:
    """[N/16, K, 16] panels -> the first n rows [n, K] of the matrix they hold (a copy, in their dtype)."""
    p, k, _ = panels.shape
    return panels.transpose(1, 2).reshape(p * PANEL, k)[:n]


def reference_half_linear(x: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The plain path: the weight rows [N, K] widened to float32 whole, one matmul (no native kernels; parity tests)."""
    return F.linear(x, rows.float(), bias)


class HalfLinear(nn.Module):
    """y = x W^T (+ b): x float32, W [N, K] bfloat16 or float16 (skinny-kernel panels, or coded), float32 out."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, coded: bool = True) -> None:
        """`coded`: hold a bfloat16 weight in 12 bits a weight where that pays (lossless; False: plain panels)."""
        super().__init__()
        if weight.dtype not in HALF_DTYPES or weight.dim() != 2:
            raise ValueError(f"HalfLinear: expected a bfloat16 or float16 [N, K] weight, got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        panels = to_panels(weight)  # [N/16, K, 16]
        held = code_panels(panels) if coded else None
        if held is None:
            self.register_buffer("half_panels", panels)
        else:  # "codes" is what bench/roofline.py counts as weight bytes (the tables and exceptions: < 0.3%)
            for name, t in held._asdict().items():
                self.register_buffer(name, t)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def coded(self) -> CodedPanels | None:
        """The 12-bit coding, read from the buffers that hold it (so it follows them through `.to()` and state
        dicts); None where the weight is held in plain panels."""
        if "codes" not in self._buffers:
            return None
        return CodedPanels(*(self._buffers[name] for name in CodedPanels._fields))

    def half_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Weight rows `ids` [T] (all where None), [T, K] in the checkpoint's dtype and values."""
        if self.coded is None:
            return panel_rows(self.half_panels, self.out_features) if ids is None else \
                self.half_panels[ids // PANEL, :, ids % PANEL]
        ids = torch.arange(self.out_features) if ids is None else ids
        return coded_rows(self.coded, ids, self.in_features)

    def float_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows `ids` [T] widened to float32 [T, K] (the tied embedding's look-ups; native where it can)."""
        mod = native_module()
        if self.coded is None or mod is None or ids.device.type != "cpu":
            return self.half_rows(ids).float()
        return mod.coded_half_rows(ids.long(), *self.coded, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [T, K]
        mod = native_module()  # None when the kernels are off (or switched off after load: tests)
        coded = self.coded
        if mod is None or rows.dtype != torch.float32 or rows.device.type != "cpu":
            y = reference_half_linear(rows.float(), self.half_rows(), self.bias)
        elif coded is None:
            y = mod.skinny_linear(rows, self.half_panels, self.out_features, self.bias)
        else:
            y = mod.coded_half_linear(rows, *coded, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        held = "12-bit coded panels" if self.coded is not None else "panels"
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, in {held}"


class HalfEmbedding(nn.Module):
    """Token ids -> float32 rows of a bfloat16 / float16 table: its own [N, K] rows, or a tied head's (held once)."""

    def __init__(self, num_embeddings: int, table: torch.Tensor | HalfLinear) -> None:
        """`table`: rows [N, K], or the tied HalfLinear whose weights the rows are looked up in (no second copy)."""
        super().__init__()
        dtype = table.dtype
        if dtype not in HALF_DTYPES:
            raise ValueError(f"HalfEmbedding: expected a bfloat16 or float16 table, got {dtype}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = table.in_features if isinstance(table, HalfLinear) else table.shape[1]
        if isinstance(table, HalfLinear):
            self.head_rows = table.float_rows  # a bound method: the head stays out of this module's tree
        else:
            self.head_rows = None
            self.register_buffer("table", table)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = self.table[ids].float() if self.head_rows is None else self.head_rows(ids)  # [T, K]
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        where = "the tied head" if self.head_rows is not None else "rows"
        return f"{self.num_embeddings}, {self.embedding_dim}, in {where}"


def tied_half(weight: torch.Tensor) -> tuple[HalfEmbedding, HalfLinear]:
    """A tied table [N, K] held once, in the head (panels or coded), which the embedding looks its rows up in."""
    head = HalfLinear(weight)
    return HalfEmbedding(weight.shape[0], head), head
