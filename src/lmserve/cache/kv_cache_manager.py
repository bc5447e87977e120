"""Per-request block tables over the block pool: prefix lookup, allocation, freeing, usage.

With a KV tier below the pool (cache/kv_tier.py), a prefix lookup goes on into the tier where the pool's
blocks end, and the manager also lists each step's copies for the runner (take_transfers; the scheduler hands
them on as sched/output.KVTransfers): blocks the pool evicts (to host memory), blocks loaded from the tier,
blocks newly filled (to disk).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from lmserve.cache.block_pool import Block, BlockPool
from lmserve.cache.kv_tier import KVTier


def block_hash(parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Content hash of a full block given its prefix's hash; `extra` separates e.g. LoRA adapters."""
    h = hashlib.sha256(parent or b"")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(extra)
    return h.digest()


@dataclass
class ComputedBlocks:
    """A prefix-cache hit: blocks whose KV is already in the cache, covering `num_tokens` tokens."""

    blocks: list[Block] = field(default_factory=list)
    num_tokens: int = 0  # the pool's blocks and the tier's together
    tier: list[bytes] = field(default_factory=list)  # hashes of the blocks after `blocks` that the KV tier holds


class KVCacheManager:
    """Maps each request to the list of blocks holding its KV, in token order."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[Block]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of each request already registered
        self.prefix_hits = 0  # tokens served from the cache since start (for stats), the tier's included
        self.tier: KVTier | None = None
        # this step's copies between the pool and the tier, as (block id, prefix hash)
        self._loads: list[tuple[int, bytes]] = []  # fresh blocks to fill from the tier
        self._persists: list[tuple[int, bytes]] = []  # blocks this step fills: to disk

    def attach_tier(self, tier: KVTier) -> None:
        """Look up prefixes in `tier` beyond the pool, and list the copies it needs each step."""
        self.tier = tier
        self.pool.evicted = []  # the pool now reports the cached blocks it reuses

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from its `start`-th block on (its whole table by default)."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())[start:]]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_computed(self, request_id: str, token_ids: Sequence[int], extra: bytes = b"",
                      allow: bool = True) -> ComputedBlocks:
        """Longest cached prefix of full blocks, leaving at least one token to compute (for its logits).

        `allow=False` skips the lookup for one request (prompt logprobs need every position computed).
        """
        if not self.enable_prefix_caching or not allow:
            return ComputedBlocks()
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = self._hashes(request_id, token_ids, extra, max_blocks)
        hit: list[Block] = []
        for h in hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hit.append(block)
        tier = self._tier_hits(hashes[len(hit):max_blocks])
        return ComputedBlocks(hit, (len(hit) + len(tier)) * self.block_size, tier)

    def _tier_hits(self, hashes: list[bytes]) -> list[bytes]:
        """The leading hashes the tier holds, stopping where the pool holds one again (never the case in practice:
        the pool evicts a prefix's tail before its head) or the tier does not."""
        hits = []
        if self.tier is not None:
            for h in hashes:
                if self.pool.lookup(h) is not None or not self.tier.contains(h):
                    break
                hits.append(h)
        return hits

    def allocate(self, request_id: str, token_ids: Sequence[int], num_computed: int, num_new: int,
                 computed: ComputedBlocks | None = None, extra: bytes = b"", num_lookahead: int = 0) -> bool:
        """Make room for `num_new` known tokens plus `num_lookahead` drafts after `num_computed`.

        Returns False (and changes nothing) if blocks run out, or if a tier block of `computed` cannot be
        read (its file failed a check: the next lookup stops before it). Only blocks filled by known tokens get
        a prefix hash (published for other requests to share); slots that drafts write are never hashed
        until the tokens there are accepted and known. Blocks from the tier get fresh pool blocks, published at
        once: the runner loads their bytes before this step's forward.
        """
        blocks = self.req_blocks.get(request_id, [])
        hit = computed.blocks if computed else []
        tier = computed.tier if computed else []
        need = self.blocks_needed(num_computed + num_new + num_lookahead) - len(blocks) - len(hit)
        reclaim = sum(1 for b in hit if b.ref_cnt == 0)  # free-queue blocks a hit would pull out
        if need > self.pool.num_free_blocks - reclaim:
            return False
        if tier and not self.tier.stage(tier):
            return False
        self.pool.touch(hit)
        fresh = self.pool.allocate(max(need, 0))
        for block, h in zip(fresh, tier):
            self.pool.cache(block, h)
            self._loads.append((block.block_id, h))
        blocks = blocks + hit + fresh
        self.req_blocks[request_id] = blocks
        if computed:
            self.prefix_hits += computed.num_tokens
        self._cache_full(request_id, blocks, token_ids, num_computed + num_new, extra)
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Roll a request back to `num_tokens` slots: free the tail blocks that only rejected drafts used.

        Hashed blocks are never among them: a hash covers known tokens only, all below num_tokens.
        """
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        keep = self.blocks_needed(num_tokens)
        if keep < len(blocks):
            self.pool.free(list(reversed(blocks[keep:])))
            del blocks[keep:]

    def free(self, request_id: str) -> None:
        """Release a request's blocks (finished, aborted or preempted)."""
        blocks = self.req_blocks.pop(request_id, [])
        self.pool.free(list(reversed(blocks)))
        self._req_hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every published prefix hash (after a failed step: its blocks were published unwritten).

        The tier keeps its blocks (each was copied from a block a finished step had written) but forgets the
        failed step's copies, which never ran or may have run half-way.
        """
        self.pool.reset_prefix_cache()
        if self.tier is not None:
            self.tier.unstage_all()
            self.pool.evicted, self._loads, self._persists = [], [], []

    def take_transfers(self) -> tuple[list[tuple[int, bytes]], ...] | None:
        """The copies this step needs between the pool and the tier, (saves, loads, persists) as sched/output.
        KVTransfers holds them (None: none)."""
        if self.tier is None:
            return None
        saves = [(b, h) for b, h in self.pool.evicted if self.tier.wants_save(h)]
        copies = (saves, self._loads, self._persists)
        self.pool.evicted, self._loads, self._persists = [], [], []
        return copies if any(copies) else None

    def _hashes(self, request_id: str, token_ids: Sequence[int], extra: bytes, num_blocks: int) -> list[bytes]:
        """Hashes of the first `num_blocks` full blocks, extended incrementally as the request grows."""
        hashes = self._req_hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(block_hash(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs], extra))
        return hashes

    def _cache_full(self, request_id: str, blocks: list[Block], token_ids: Sequence[int], num_tokens: int,
                    extra: bytes) -> None:
        """Register the blocks that will be full once this step's tokens are written."""
        if not self.enable_prefix_caching:
            return
        full = min(num_tokens, len(token_ids)) // self.block_size
        done = self._num_cached.get(request_id, 0)
        if full <= done:
            return
        hashes = self._hashes(request_id, token_ids, extra, full)
        for block, h in zip(blocks[done:full], hashes[done:full]):
            if self.pool.cache(block, h) and self.tier is not None and self.tier.wants_persist(h):
                self._persists.append((block.block_id, h))  # written by this step: to disk after it
        self._num_cached[request_id] = full
