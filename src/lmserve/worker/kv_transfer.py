"""Whole-block copies between the runner's KV tensors and host memory: the runner's half of the KV tier.

A block's bytes are its slice of every block-indexed tensor the runner holds (`ModelRunner.kv_block_tensors`:
each layer's K/V today, and any per-block scale tensors a quantized cache adds), one after another as raw bytes.
Nothing here reads the element type, so a loaded block is bit for bit the block that was saved, and the same
logits follow from it as from recomputing it. Batches of blocks move with one gather or scatter per tensor.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lmserve.sched.output import KVTransfers


class TierStore(Protocol):
    """What the copies read and feed (cache/kv_tier.KVTier)."""

    def take_staged(self, block_hash: bytes) -> torch.Tensor: ...

    def save(self, items: list[tuple[bytes, torch.Tensor]]) -> None: ...

    def persist(self, items: list[tuple[bytes, torch.Tensor]]) -> None: ...


class BlockCopier:
    """Gathers blocks out of, and scatters them into, a set of tensors that share one block index."""

    def __init__(self, tensors: list[tuple[torch.Tensor, int]]) -> None:
        """`tensors`: (tensor, the dimension its block index runs along)."""
        # one-byte element types as raw bytes: the same bytes and shapes, and torch has no index_copy_ for float8
        # (a --kv-cache-dtype fp8_e4m3 cache)
        self.tensors = [(t.view(torch.uint8) if t.element_size() == 1 else t, d) for t, d in tensors]
        self.dtypes = [t.dtype for t, _ in tensors]  # the element types the layout names
        self.sizes = [t.select(d, 0).numel() * t.element_size() for t, d in tensors]  # bytes of one block in each
        self.block_bytes = sum(self.sizes)
        self.pin = any(t.device.type == "cuda" for t, _ in tensors)  # host buffers a DMA can read

    def layout(self) -> str:
        """Element type and per-block shape of every tensor: part of what the tier keys blocks by."""
        parts = []
        for (t, d), dtype in zip(self.tensors, self.dtypes):
            shape = [n for i, n in enumerate(t.shape) if i != d]
            parts.append(f"{str(dtype).removeprefix('torch.')}{shape}@{d}")
        return ";".join(parts)

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' bytes: [len(block_ids), block_bytes] uint8 on the CPU."""
        n = len(block_ids)
        out = torch.empty(n, self.block_bytes, dtype=torch.uint8, pin_memory=self.pin)
        off = 0
        for (t, d), size in zip(self.tensors, self.sizes):
            idx = torch.as_tensor(block_ids, device=t.device)
            part = t.index_select(d, idx).movedim(d, 0).reshape(n, -1)  # [n, elements of one block]
            out[:, off:off + size].copy_(part.view(torch.uint8))
            off += size
        return out

    def scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write [len(block_ids), block_bytes] uint8 into those blocks of every tensor."""
        n = len(block_ids)
        off = 0
        for (t, d), size in zip(self.tensors, self.sizes):
            idx = torch.as_tensor(block_ids, device=t.device)
            # contiguous first: a slice's offset need not be aligned for a wider element type
            part = data[:, off:off + size].contiguous().to(t.device).view(t.dtype)
            shape = [n] + [s for i, s in enumerate(t.shape) if i != d]
            t.index_copy_(d, idx, part.reshape(shape).movedim(0, d))
            off += size


class KVTransfer:
    """Runs a step's KVTransfers against the tier: saves and loads before the forward, persists after it."""

    def __init__(self, copier: BlockCopier, store: TierStore) -> None:
        self.copier, self.store = copier, store

    def before_forward(self, t: KVTransfers) -> None:
        """Copy out the evicted blocks' old KV, then fill the loaded blocks (one may be the other's block)."""
        if t.saves:
            data = self.copier.gather([b for b, _ in t.saves])
            # a tensor per block: the host tier drops blocks one by one, and a view would pin the whole batch
            self.store.save([(h, row.clone()) for (_, h), row in zip(t.saves, data)])
        if t.loads:
            data = torch.stack([self.store.take_staged(h) for _, h in t.loads])
            self.copier.scatter([b for b, _ in t.loads], data)

    def after_forward(self, t: KVTransfers) -> None:
        """Hand the blocks this step filled to the disk writer (rows of one buffer, freed once all are written)."""
        if t.persists:
            data = self.copier.gather([b for b, _ in t.persists])
            self.store.persist([(h, row) for (_, h), row in zip(t.persists, data)])
