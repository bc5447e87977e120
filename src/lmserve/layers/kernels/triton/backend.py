"""`TritonPagedAttention`: the AttentionContext of `--attention-backend triton`, over the engine's paged KV cache.

Same metadata and same contract as the reference `PagedAttention` (layers/attention/paged.py): this step's
K/V are stored at their slots first, then the decode group (one query row per token, its own context length)
goes through the split-K decode kernel and the prefill chunks through the extend kernel, both reading K/V in
place through the block tables; nothing is gathered. Its decode path reads only device tensors whose shapes
are fixed for a batch-size bucket, so the fixed-shape decode step of worker/cuda_graphs.py captures it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmserve.layers.attention.context import AttnOptions
from lmserve.layers.attention.paged import PagedAttention, PagedAttentionMetadata, PagedRows, write_kv
from lmserve.layers.kernels.triton.decode import paged_decode
from lmserve.layers.kernels.triton.prefill import paged_prefill


@dataclass
class TritonPagedAttention(PagedRows):  # rows(): replace re-runs __post_init__ for the part
    """AttentionContext over the KV cache (one [2, blocks, block_size, kv_heads, head_dim] per layer)."""

    kv_caches: list[torch.Tensor]
    meta: PagedAttentionMetadata

    def __post_init__(self) -> None:
        # the longest prefill chunk sizes the extend kernel's grid: host ints, read once per forward, not per layer
        self.max_query_len = max((p.q_len for p in self.meta.prefills), default=0)
        # a step with bidirectional spans (Gemma 3's images): the extend kernel is causal only, the reference is not
        self.reference = PagedAttention(self.kv_caches, self.meta) if any(p.spans for p in self.meta.prefills) else None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               opts: AttnOptions | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (decode group first, then prefill chunks) -> [T, H * D]."""
        if self.reference is not None:
            return self.reference.attend(layer_idx, q, k, v, opts if opts is not None else AttnOptions())
        cache, m = self.kv_caches[layer_idx], self.meta
        write_kv(cache, k, v, m.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D], contiguous
        n = m.num_decodes
        if n:
            paged_decode(q[:n], cache[0], cache[1], m.decode_block_tables, m.decode_context_lens, opts, out=out[:n])
        if self.max_query_len:
            paged_prefill(q[n:], cache[0], cache[1], m.prefill_block_tables, m.prefill_query_start_loc,
                          m.prefill_seq_lens, self.max_query_len, opts, out=out[n:])
        return out.view(q.shape[0], -1)
