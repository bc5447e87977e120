"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a top-k softmax router over gated experts.

Each token's router logits pick its top-k experts; their softmax weights are renormalised to sum to 1 where the
config says so (`norm_topk_prob`). The (token, expert) pairs are sorted by expert, each active expert runs one
matmul pair over its run of rows, and every pair's output goes back to its own row, [T, k, hidden], where the
k weighted outputs are summed per token. Summing per row (rather than scatter-adding into a shared buffer) keeps
the order of the additions fixed, so a token's result never depends on which other tokens share its batch
(tests/test_moe.py checks it bit for bit, as tests/test_quantized.py does for the linears).

Every expert is a `GatedMLP`, so the weight-format transforms apply to experts as to any linear: oneDNN packing,
int8/int4, and a GGUF file's 3-D `*_exps` tensors kept in their blocks one expert slice at a time
(loader/gguf_packed.py). Tensor parallelism splits each expert's intermediate width like the dense MLP's, and
all-reduces the layer's combined output once (layers/formats/parallel.py). This module is the plain path that every device
runs; the pipeline's moe_kernels step (worker/transforms.py, layers/kernels/moe_kernels.py) gives `SparseMoE.grouped` a
fast one: the native kernels' stacked experts on CPU, the fused Triton grouped GEMM (layers/kernels/triton/moe.py) on CUDA.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.layers.blocks.mlp import GatedMLP


class Routing(NamedTuple):
    """Each token's chosen experts and their weights."""

    weights: torch.Tensor  # [T, k] float32
    experts: torch.Tensor  # [T, k] int64, in descending router weight


def route(logits: torch.Tensor, top_k: int, renormalize: bool, softmax_after_topk: bool = False) -> Routing:
    """Softmax over the experts in float32, the top k, optionally renormalised to sum to 1 (as transformers); or,
    `softmax_after_topk` (gpt-oss), the top k logits and a softmax over those k."""
    if softmax_after_topk:
        logits, experts = torch.topk(logits, top_k, dim=-1)  # [T, k]
        return Routing(F.softmax(logits, dim=-1, dtype=torch.float32), experts)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, experts)


class ExpertRows(NamedTuple):
    """The T * k (token, expert) pairs sorted by expert: pair p is token p // k, slot p % k."""

    order: torch.Tensor  # [T * k] int64: the pairs, expert-major (token order within one expert)
    token: torch.Tensor  # [T * k] int64: each sorted pair's token
    offsets: torch.Tensor  # [E + 1] int64: expert e's pairs are order[offsets[e]:offsets[e + 1]]


def group_by_expert(routing: Routing, num_experts: int) -> ExpertRows:
    """One stable sort of the pairs by expert, and each expert's run."""
    flat = routing.experts.flatten()  # [T * k]
    order = torch.argsort(flat, stable=True)
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    torch.cumsum(torch.bincount(flat, minlength=num_experts), 0, out=offsets[1:])
    return ExpertRows(order, order // routing.experts.shape[1], offsets)


def combine(out: torch.Tensor, rows: ExpertRows, routing: Routing) -> torch.Tensor:
    """The experts' outputs [T * k, hidden] in sorted order -> sum_j weight[t, j] * output of pair (t, j): [T, hidden].

    The pairs go back to pair order first and each token's k outputs are summed in slot order, so the additions
    happen in an order fixed by the token alone (never by its batch)."""
    num_tokens, top_k = routing.experts.shape
    pairs = torch.empty_like(out)
    pairs[rows.order] = out
    weighted = pairs.view(num_tokens, top_k, -1) * routing.weights.to(out.dtype).unsqueeze(-1)  # [T, k, hidden]
    return weighted.sum(dim=1)


def run_experts(x: torch.Tensor, experts: nn.ModuleList, routing: Routing) -> torch.Tensor:
    """sum_j weight[t, j] * experts[id[t, j]](x[t]) for every token t: x [T, hidden] -> [T, hidden].

    The module path: the pairs sorted by expert, each active expert's module called once over its contiguous run.
    """
    rows = group_by_expert(routing, len(experts))
    # run lengths on the host: one small copy per layer (layers/kernels/moe_kernels.py's paths never read them back)
    ends = rows.offsets.tolist()
    gathered = x[rows.token]  # [T * k, hidden], expert-major
    out = torch.empty_like(gathered)
    for expert, start, end in zip(experts, ends, ends[1:]):
        if end > start:
            out[start:end] = expert(gathered[start:end])
    return combine(out, rows, routing)


class SparseMoE(nn.Module):
    """Router (`gate`), experts and, for Qwen2-MoE, a shared expert scaled by sigmoid(`shared_expert_gate`(x)).

    Parameter names follow Qwen's checkpoints (`mlp.gate`, `mlp.experts.{e}`, `mlp.shared_expert`); the family
    hooks (models/moe.py, gpt_oss.py) rename Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3` and gpt-oss's
    `mlp.router`, and split stacked experts. `bias`: the router and every expert projection have one (gpt-oss).
    """

    def __init__(self, hidden_size: int, expert_size: int, num_experts: int, top_k: int, renormalize: bool,
                 act: str = "silu", shared_size: int = 0, bias: bool = False,
                 softmax_after_topk: bool = False) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.softmax_after_topk = top_k, renormalize, softmax_after_topk
        self.gate = nn.Linear(hidden_size, num_experts, bias=bias)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, expert_size, bias, act) for _ in range(num_experts))
        self.shared_expert = GatedMLP(hidden_size, shared_size, False, act) if shared_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_size else None
        # the fast expert path a transform installs (layers/kernels/moe_kernels.py); None: the module path
        self.grouped: nn.Module | None = None

    def route(self, x: torch.Tensor) -> Routing:
        """x [T, hidden] -> each token's experts and weights (router logits [T, E])."""
        return route(self.gate(x), self.top_k, self.renormalize, self.softmax_after_topk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.route(x)
        if self.grouped is not None and self.grouped.accepts(x, routing):
            out = self.grouped(x, routing)
        else:
            out = run_experts(x, self.experts, routing)
        if self.shared_expert is not None:
            out = out + shared_gate(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def shared_gate(logit: torch.Tensor) -> torch.Tensor:
    """sigmoid of the shared expert's gate logits [T, 1], each row's bits the same whatever T.

    torch's elementwise loops run two vectors at a time through Sleef and the leftover elements through the scalar
    libm, whose last bits differ: in a [T, 1] column a row's path depended on T (16 rows: vectors on AVX2; 1 row:
    scalar), so a token's output changed with its batch. Each row widened to 32 lanes (two AVX-512 vectors, four
    AVX2 ones) always takes the vector path; 16 lanes did on AVX2 only (one AVX-512 vector is a leftover)."""
    return torch.sigmoid(logit.expand(-1, 32).contiguous())[:, :1]


def reference_moe(x: torch.Tensor, moe: SparseMoE) -> torch.Tensor:
    """The same layer token by token, each token's experts in slot order (the parity reference for `run_experts`)."""
    routing = moe.route(x)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for w, e in zip(routing.weights[t].tolist(), routing.experts[t].tolist()):
            acc = acc + w * moe.experts[e](x[t:t + 1])[0]
        rows.append(acc)
    out = torch.stack(rows)
    if moe.shared_expert is not None:
        out = out + shared_gate(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    return out
