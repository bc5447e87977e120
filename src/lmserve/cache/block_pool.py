"""A pool of fixed-size KV blocks with reference counts and a free queue in eviction order.

Freed blocks that hold a full, hashed run of tokens stay findable by hash until they are reused,
which gives prefix caching (and sharing between the `n` completions of one prompt) for free.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    """One block of `block_size` token slots in every layer's cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and its tokens are known


class BlockPool:
    """Owns every block; hands them out, takes them back, remembers full blocks by content hash."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> None, oldest first: the head is evicted (reused) first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, Block] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[Block]:
        """Take n blocks from the head of the free queue (caller checked there are enough)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block = self.blocks[self._free.popitem(last=False)[0]]
            if block.block_hash is not None:  # its old contents are about to be overwritten
                if self._by_hash.get(block.block_hash) is block:
                    del self._by_hash[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: bytes) -> Block | None:
        """A block already holding exactly these tokens (after this prefix), if any."""
        return self._by_hash.get(block_hash)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference on each block; unreferenced blocks rejoin the free queue's tail.

        Callers pass a sequence's blocks in reverse so that its tail blocks, least likely to be
        shared, are evicted before its prefix.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"KV block {block.block_id} freed more often than allocated")
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Record that a full block holds the tokens identified by `block_hash`."""
        if block.block_hash is None and block_hash not in self._by_hash:
            block.block_hash = block_hash
            self._by_hash[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change)."""
        for block in self._by_hash.values():
            block.block_hash = None
        self._by_hash.clear()
