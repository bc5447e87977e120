"""A pool of fixed-size KV blocks with reference counts and free lists in reuse order.

Freed blocks that hold a full, hashed run of tokens stay findable by hash until they are reused,
which gives prefix caching (and sharing between the `n` completions of one prompt) for free.

Reuse order (the KV tensors are committed page by page as blocks are first written, see
worker/kv_memory.py, so the order decides how much memory a server touches):
1. freed blocks that hold nothing findable, most recently freed first (LIFO: their pages are resident
   and likely still in cache);
2. cached free blocks beyond the retention budget (an eighth of the pool, at least 16 blocks), least
   recently freed first (the prefix cache's eviction order: a sequence's tail before its prefix);
3. blocks never handed out, lowest id first;
4. the remaining cached free blocks, least recently freed first.
So a server touches pages for its peak of blocks in use plus at most the budget of kept prefixes, not
for the pool's size (streams of distinct prompts do not grow its memory to the pool), while recent
prefixes survive other requests as they would in vLLM (a prefix evicted only when nothing else is free,
up to the budget).
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

    def __init__(self, num_blocks: int, retain: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        # cached free blocks kept before never-used ones are taken (see the module docstring)
        self.retain = max(16, num_blocks // 8) if retain is None else retain
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._recycled: list[int] = []  # freed, no hash: a stack, the top is reused first
        # free with a hash, block_id -> None, oldest first: the head is evicted first
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._next_fresh = 0  # blocks [_next_fresh, num_blocks) were never handed out (their pages untouched)
        self._by_hash: dict[bytes, Block] = {}
        # (block id, old hash) of each cached block handed out for new tokens, when a KV tier listens (else None)
        self.evicted: list[tuple[int, bytes]] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._recycled) + len(self._cached) + self.num_blocks - self._next_fresh

    @property
    def num_touched_blocks(self) -> int:
        """Blocks handed out at least once since start: what the KV cache's resident memory pays for."""
        return self._next_fresh

    def allocate(self, n: int) -> list[Block]:
        """Take n free blocks in reuse order (caller checked there are enough)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.blocks[self._take()]
            if block.block_hash is not None:  # its old contents are about to be overwritten
                if self._by_hash.get(block.block_hash) is block:
                    del self._by_hash[block.block_hash]
                    if self.evicted is not None:
                        self.evicted.append((block.block_id, block.block_hash))
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def _take(self) -> int:
        """The next free block id in reuse order (see the module docstring)."""
        if self._recycled:
            return self._recycled.pop()
        if len(self._cached) > self.retain:
            return self._cached.popitem(last=False)[0]
        if self._next_fresh < self.num_blocks:
            self._next_fresh += 1
            return self._next_fresh - 1
        return self._cached.popitem(last=False)[0]

    def lookup(self, block_hash: bytes) -> Block | None:
        """A block already holding exactly these tokens (after this prefix), if any."""
        return self._by_hash.get(block_hash)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the free lists."""
        for block in blocks:
            if block.ref_cnt == 0:
                if block.block_id in self._cached:
                    del self._cached[block.block_id]
                else:  # a hit always has a hash; this keeps the lists true even if one was reset since
                    self._recycled.remove(block.block_id)
            block.ref_cnt += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference on each block; unreferenced blocks rejoin a free list.

        Callers pass a sequence's blocks in reverse so that its tail blocks, least likely to be
        shared, are evicted before its prefix.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"KV block {block.block_id} freed more often than allocated")
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._cached[block.block_id] = None
                else:
                    self._recycled.append(block.block_id)

    def cache(self, block: Block, block_hash: bytes) -> bool:
        """Record that a full block holds the tokens identified by `block_hash`; False when it was already
        published, or another block holds those tokens."""
        if block.block_hash is None and block_hash not in self._by_hash:
            block.block_hash = block_hash
            self._by_hash[block_hash] = block
            return True
        return False

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change); cached free blocks become plain free ones."""
        for block in self._by_hash.values():
            block.block_hash = None
        self._by_hash.clear()
        self._recycled.extend(reversed(self._cached))  # the oldest ends on top, as it would have been evicted first
        self._cached.clear()
