"""Fused mixture-of-experts layer: tokens sorted by expert on the device, then one grouped GEMM per projection.

Each (token, chosen expert) pair is a row. `sort_by_expert` orders the rows by expert and pads every expert's
run to a multiple of BLOCK_M, so each BLOCK_M-row block of the sorted order belongs to one expert. Its outputs
have shapes fixed by the token count alone (room for the worst case of padding) and it never reads a value
back to the host, so a step with MoE layers can still be captured in a CUDA graph; blocks left unused are
marked with expert -1 and their programs return at once. The grouped GEMM then runs one program per
(block, tile of output columns): it gathers the block's rows of A, multiplies by its expert's weight and
scatters the result back to the rows' own places (for the down projection, scaled by the router weight).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lmserve.layers.blocks.moe import Routing
from lmserve.layers.kernels.triton import dot_flags, interpreting


class ExpertOrder(NamedTuple):
    """The rows (token, expert pairs) in expert order, padded per expert to whole blocks."""

    sorted_rows: torch.Tensor  # [num_blocks * block_m] int64: a row index (token * top_k + slot), or num_rows (padding)
    block_experts: torch.Tensor  # [num_blocks] int64: each block's expert, -1 for a block past the last expert's run
    block_m: int


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertOrder:
    """Group the rows of topk_ids [T, top_k] by expert with device ops only (no host sync, static shapes)."""
    flat = topk_ids.flatten().long()  # [N] row r = token r // top_k, slot r % top_k
    rows = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # rows by expert, in token order within one
    expert = flat[order]
    rank = torch.arange(rows, device=flat.device) - (counts.cumsum(0) - counts)[expert]  # place within its expert
    dest = (padded_end - padded)[expert] + rank
    # at most min(rows, experts) runs are non-empty, each padded by fewer than block_m rows
    num_blocks = triton.cdiv(rows + min(rows, num_experts) * (block_m - 1), block_m)
    sorted_rows = torch.full((num_blocks * block_m,), rows, dtype=torch.long, device=flat.device)
    sorted_rows.scatter_(0, dest, order)
    starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_end, starts, right=True)  # the run each block starts in
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return ExpertOrder(sorted_rows, block_experts, block_m)


@triton.jit
def _grouped_gemm_kernel(
        A, W, C, SortedRows, BlockExperts, RowWeights,
        num_rows, N, K, stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
        A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    block, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(BlockExperts + block)
    if expert < 0:
        return
    rows = tl.load(SortedRows + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    a_rows = rows // A_ROW_DIV  # the first projection reads its token's activation: row // top_k
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(A + a_rows[:, None] * stride_am + k[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(W + expert.to(tl.int64) * stride_we + k[:, None] * stride_wk + n[None, :] * stride_wn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]: W[e] is [N, K]
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(RowWeights + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(C + rows[:, None] * stride_cm + n[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, order: ExpertOrder, num_rows: int, a_row_div: int,
                 out_dtype: torch.dtype, row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """C[r] = A[r // a_row_div] @ W[expert(r)].T for every row r (times row_weights[r] when given): [num_rows, N]."""
    n_out, k = w.shape[1], w.shape[2]
    c = torch.empty(num_rows, n_out, dtype=out_dtype, device=a.device)
    block_n = 32 if interpreting() else 64
    grid = (order.block_experts.shape[0], triton.cdiv(n_out, block_n))
    _grouped_gemm_kernel[grid](
        a, w, c, order.sorted_rows, order.block_experts, row_weights if row_weights is not None else c,
        num_rows, n_out, k, a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=row_weights is not None, BLOCK_M=order.block_m, BLOCK_N=block_n,
        BLOCK_K=32, **dot_flags(a.dtype))
    return c


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over x [T, hidden]: w13 [E, 2 * inter, hidden] (gate rows, then up rows), w2 [E, hidden, inter],
    topk_ids / topk_weights [T, k] from the router. Returns [T, hidden] in x's dtype (`reference.fused_moe_reference`)."""
    tokens, top_k = topk_ids.shape
    rows = tokens * top_k
    order = sort_by_expert(topk_ids, w13.shape[0], 16 if interpreting() else 64)
    h = grouped_gemm(x, w13, order, rows, top_k, x.dtype)  # [rows, 2 * inter]
    inter = w2.shape[2]
    act = F.silu(h[:, :inter]) * h[:, inter:]  # [rows, inter]
    y = grouped_gemm(act, w2, order, rows, 1, torch.float32, topk_weights.flatten())  # [rows, hidden], weighted
    return y.view(tokens, top_k, -1).sum(dim=1).to(x.dtype)


class TritonExperts(torch.nn.Module):
    """A SparseMoE's experts through `fused_moe` (the `SparseMoE.grouped` seam, layers/kernels/moe_kernels.py): gate_up
    stacked into w13 [E, 2 * inter, hidden] and down into w2 [E, hidden, inter]. The experts' own weights become views
    of the stacks, so the module path (the reference) and this one share one copy."""

    graph_safe = True  # no host sync (layers/moe_kernels.host_synced_moe_layers)

    def __init__(self, experts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.register_buffer("w13", torch.stack([e.gate_up_proj.weight.detach() for e in experts]))
        self.register_buffer("w2", torch.stack([e.down_proj.weight.detach() for e in experts]))
        for i, e in enumerate(experts):
            e.gate_up_proj.weight = torch.nn.Parameter(self.w13[i], requires_grad=False)
            e.down_proj.weight = torch.nn.Parameter(self.w2[i], requires_grad=False)

    def accepts(self, x: torch.Tensor, routing: Routing) -> bool:
        """Every step runs here (static shapes, no host sync: CUDA graphs can capture it)."""
        return x.dtype == self.w13.dtype

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        return fused_moe(x, self.w13, self.w2, routing.weights, routing.experts)
