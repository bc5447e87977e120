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
all-reduces the layer's combined output once (layers/parallel.py). On CUDA, layers/triton/moe.py is the fused
grouped-GEMM path; this module is the plain one that every device runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lmserve.layers.mlp import GatedMLP


class Routing(NamedTuple):
    """Each token's chosen experts and their weights."""

    weights: torch.Tensor  # [T, k] float32
    experts: torch.Tensor  # [T, k] int64, in descending router weight


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over the experts in float32, the top k, optionally renormalised to sum to 1 (as transformers)."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, experts)


def run_experts(x: torch.Tensor, experts: nn.ModuleList, routing: Routing) -> torch.Tensor:
    """sum_j weight[t, j] * experts[id[t, j]](x[t]) for every token t: x [T, hidden] -> [T, hidden].

    The T * k pairs are sorted by expert (stable: token order within one), each active expert runs once over its
    contiguous run, and the outputs are put back in pair order before the per-token weighted sum.
    """
    num_tokens, top_k = routing.experts.shape
    flat = routing.experts.flatten()  # [T * k]: pair p is token p // k, slot p % k
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    # Run lengths on the host: one small copy per layer (the CPU path's experts are modules called one by one;
    # the CUDA path sorts on the device instead: layers/triton/moe.py).
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    rows = x[order // top_k]  # [T * k, hidden], expert-major
    out = torch.empty_like(rows)
    start = 0
    for expert, n in zip(experts, counts):
        if n:
            out[start:start + n] = expert(rows[start:start + n])
            start += n
    pairs = torch.empty_like(out)
    pairs[order] = out  # back to pair order
    weighted = pairs.view(num_tokens, top_k, -1) * routing.weights.to(x.dtype).unsqueeze(-1)  # [T, k, hidden]
    return weighted.sum(dim=1)


class SparseMoE(nn.Module):
    """Router (`gate`), experts and, for Qwen2-MoE, a shared expert scaled by sigmoid(`shared_expert_gate`(x)).

    Parameter names follow Qwen's checkpoints (`mlp.gate`, `mlp.experts.{e}`, `mlp.shared_expert`); the family
    hooks (models/moe.py) rename Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3` and split stacked experts.
    """

    def __init__(self, hidden_size: int, expert_size: int, num_experts: int, top_k: int, renormalize: bool,
                 act: str = "silu", shared_size: int = 0) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden_size, expert_size, False, act) for _ in range(num_experts))
        self.shared_expert = GatedMLP(hidden_size, shared_size, False, act) if shared_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = route(self.gate(x), self.top_k, self.renormalize)  # x [T, hidden], router logits [T, E]
        out = run_experts(x, self.experts, routing)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def reference_moe(x: torch.Tensor, moe: SparseMoE) -> torch.Tensor:
    """The same layer token by token, each token's experts in slot order (the parity reference for `run_experts`)."""
    routing = route(moe.gate(x), moe.top_k, moe.renormalize)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for w, e in zip(routing.weights[t].tolist(), routing.experts[t].tolist()):
            acc = acc + w * moe.experts[e](x[t:t + 1])[0]
        rows.append(acc)
    out = torch.stack(rows)
    if moe.shared_expert is not None:
        out = out + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    return out
