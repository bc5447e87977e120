"""Per-request block tables over the block pool: prefix lookup, allocation, freeing, usage.

With a KV tier below the pool (cache/kv_tier.py), a prefix lookup finds each group's blocks in the pool or, where
the pool lost them, in the tier, and the manager also lists each step's copies for the runner (take_transfers;
the scheduler hands them on as sched/output.KVTransfers): blocks the pool evicts (to host memory), blocks loaded
from the tier, blocks newly filled (to disk). Every group's blocks go to the tier under their group's key; a hit
restores what each group needs: every block for a full-attention group, the blocks its window reaches from the
hit's end for a window group (as a pool hit does).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from lmserve.cache.block_pool import Block, BlockPool
from lmserve.cache.kv_groups import KVGroup, first_needed_block, peak_blocks
from lmserve.cache.kv_tier import KVTier
from lmserve.cache.sizing import blocks_for
from lmserve.request import BlockSalt


def block_hash(parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Content hash of a full block given its prefix's hash; `extra` separates e.g. LoRA adapters."""
    h = hashlib.sha256(parent or b"")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(extra)
    return h.digest()


@dataclass
class ComputedBlocks:
    """A prefix-cache hit: per KV group, the blocks whose KV is already cached, covering `num_tokens` tokens: a
    pool block, the key of a block the KV tier holds (loaded into a fresh block at allocation), or None where a
    window group needs no block (its window starts after it)."""

    tables: list[list[Block | bytes | None]] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def blocks(self) -> list[Block | bytes | None]:
        """The first group's hit (the only one for a model without window groups)."""
        return self.tables[0] if self.tables else []


class KVCacheManager:
    """Maps each request to its block table per KV group (cache/kv_groups.py), in token order.

    Every group of a request has a table of the same length (one entry per `block_size` tokens); a window group
    releases the blocks its window left (cache/kv_groups.first_needed_block) before each allocation, and its
    table holds None there. The runner reads those entries as `null_block`, never unmasked.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 groups: Sequence[KVGroup] | None = None, max_step_tokens: int | None = None) -> None:
        """`groups`: the model's KV groups (None: one that keeps every block); `max_step_tokens`: the most tokens a
        request computes in one step (the scheduler's token budget), which bounds what a window group holds."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.groups = tuple(groups) if groups else (KVGroup(()),)
        self.max_step_tokens = max_step_tokens
        # what a table says where a window group released its block: one past the pool's ids (the runner's scratch
        # block), read only under a window mask
        self.null_block = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[list[Block | None]]] = {}  # per request, per group
        self._released: dict[str, list[int]] = {}  # per request, per group: entries below were released (None)
        self._req_hashes: dict[str, list[bytes]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of each request already registered
        self.prefix_hits = 0  # tokens served from the cache since start (for stats), the tier's included
        self.tier: KVTier | None = None
        # this step's copies between the pool and the tier, as (block id, prefix hash)
        self._loads: list[tuple[int, bytes]] = []  # fresh blocks to fill from the tier
        self._persists: list[tuple[int, bytes]] = []  # blocks this step fills: to disk

    def attach_tier(self, tier: KVTier) -> None:
        """Look up prefixes in `tier` where the pool lacks blocks, and list the copies it needs each step."""
        self.tier = tier
        self.pool.evicted = []  # the pool now reports the cached blocks it reuses

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str, start: int = 0, group: int = 0) -> list[int]:
        """One group's block ids of the request from its `start`-th block on (its whole table by default)."""
        tables = self.req_blocks.get(request_id)
        if not tables:
            return []
        return [self.null_block if b is None else b.block_id for b in tables[group][start:]]

    def table_ids(self, request_id: str, start: int = 0) -> list[int]:
        """Every group's block ids from the `start`-th on, group after group (each group has as many)."""
        return [i for g in range(len(self.groups)) for i in self.block_ids(request_id, start, g)]

    def held_blocks(self, request_id: str) -> int:
        """Blocks the request references now, over every group (released ones not counted)."""
        return sum(b is not None for t in self.req_blocks.get(request_id, ()) for b in t)

    def num_blocks_of(self, request_id: str) -> int:
        """Length of the request's table (the same in every group)."""
        tables = self.req_blocks.get(request_id)
        return len(tables[0]) if tables else 0

    def blocks_needed(self, num_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, over every group."""
        return peak_blocks(self.groups, num_tokens, self.block_size, self.max_step_tokens)

    def find_computed(self, request_id: str, token_ids: Sequence[int], extra: bytes | BlockSalt = b"",
                      allow: bool = True) -> ComputedBlocks:
        """Longest cached prefix of full blocks, leaving at least one token to compute (for its logits).

        A full-attention group needs every block of the prefix; a window group only those its window reaches
        from the first token to compute (vLLM's rule): the hit is the longest prefix every group can serve.
        `allow=False` skips the lookup for one request (prompt logprobs need every position computed).
        """
        if not self.enable_prefix_caching or not allow:
            return ComputedBlocks()
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = self._hashes(request_id, token_ids, extra, max_blocks)[:max_blocks]
        n = len(hashes)
        found: list[list[Block | bytes | None]] = [[] for _ in self.groups]
        for g, group in enumerate(self.groups):
            if group.window is None:  # every block of the prefix, up to the first miss
                found[g] = self._cached_run(hashes[:n], g)
                n = len(found[g])
        for g, group in enumerate(self.groups):
            if group.window is not None:
                found[g] = [self._cached(h, g) for h in hashes[:n]]
        n = self._window_hit(found, n)
        tables = []
        for g in range(len(self.groups)):
            first = self._first_needed(g, n * self.block_size)
            tables.append([None] * first + found[g][first:n])
        return ComputedBlocks(tables, n * self.block_size)

    def _cached(self, block_hash: bytes, group: int) -> Block | bytes | None:
        """One group's block of these tokens: in the pool, else its key if the tier holds it, else None."""
        key = group_key(block_hash, group)
        block = self.pool.lookup(key)
        if block is None and self.tier is not None and self.tier.contains(key):
            return key
        return block

    def _cached_run(self, hashes: list[bytes], group: int) -> list[Block | bytes]:
        """One group's cached blocks of these tokens up to the first one neither the pool nor the tier holds."""
        run = []
        for h in hashes:
            found = self._cached(h, group)
            if found is None:
                break
            run.append(found)
        return run

    def _window_hit(self, found: list[list[Block | bytes | None]], n: int) -> int:
        """The longest hit of at most n blocks for which every window group has the blocks its window reaches:
        where a needed block is missing, no longer hit can use it, so the hit ends before it; until all agree."""
        windowed = [g for g, group in enumerate(self.groups) if group.window is not None]
        changed = True
        while changed and n > 0:
            changed = False
            for g in windowed:
                missing = [i for i in range(self._first_needed(g, n * self.block_size), n) if found[g][i] is None]
                if missing:
                    n, changed = missing[-1], True
        return n

    def _first_needed(self, group: int, num_computed: int) -> int:
        return first_needed_block(num_computed, self.groups[group].window, self.block_size)

    def allocate(self, request_id: str, token_ids: Sequence[int], num_computed: int, num_new: int,
                 computed: ComputedBlocks | None = None, extra: bytes | BlockSalt = b"", num_lookahead: int = 0) -> bool:
        """Make room for `num_new` known tokens plus `num_lookahead` drafts after `num_computed`.

        First a window group releases the blocks its window left. Returns False (and changes nothing else) if
        blocks run out, or if a tier block of `computed` cannot be read (its file failed a check: the next lookup
        stops before it). Only blocks filled by known tokens get a prefix hash (published for other requests to
        share); slots that drafts write are never hashed until the tokens there are accepted and known. Blocks
        from the tier get fresh pool blocks, published at once: the runner loads their bytes before this step's
        forward.
        """
        tables = self.req_blocks.get(request_id)
        if tables is not None:
            self._release(request_id, tables, num_computed)
        hit = computed.tables if computed and computed.tables else [[] for _ in self.groups]
        have = (len(tables[0]) if tables else 0) + len(hit[0])
        need = max(blocks_for(num_computed + num_new + num_lookahead, self.block_size) - have, 0)
        cached = [b for t in hit for b in t if isinstance(b, Block)]
        loads = [[k for k in t if isinstance(k, bytes)] for t in hit]  # per group: what the tier restores
        num_loads = sum(map(len, loads))
        reclaim = sum(1 for b in cached if b.ref_cnt == 0)  # free blocks a hit pulls out
        if need * len(self.groups) + num_loads > self.pool.num_free_blocks - reclaim:
            return False
        if num_loads and not self.tier.stage([k for keys in loads for k in keys], counted=len(loads[0])):
            return False
        if tables is None:
            tables = self.req_blocks[request_id] = [[] for _ in self.groups]
            # a window group's hit starts with the entries its window no longer reaches (None)
            self._released[request_id] = [next((i for i, b in enumerate(t) if b is not None), len(t)) for t in hit]
        self.pool.touch(cached)  # every group's before any allocation, which could otherwise evict them
        for g, table in enumerate(tables):
            table.extend([self._restore(b) if isinstance(b, bytes) else b for b in hit[g]] + self.pool.allocate(need))
        if computed:
            self.prefix_hits += computed.num_tokens
        self._cache_full(request_id, tables, token_ids, num_computed + num_new, extra)
        return True

    def _restore(self, key: bytes) -> Block:
        """A fresh block for a tier block, published now: the runner loads its bytes before this step's forward."""
        block = self.pool.allocate(1)[0]
        self.pool.cache(block, key)
        self._loads.append((block.block_id, key))
        return block

    def _release(self, request_id: str, tables: list[list[Block | None]], num_computed: int) -> None:
        """Free each window group's blocks that no query from position `num_computed` on can see."""
        released = self._released[request_id]
        for g, table in enumerate(tables):
            first = self._first_needed(g, num_computed)
            if first > released[g]:
                self.pool.free([b for b in reversed(table[released[g]:first]) if b is not None])
                table[released[g]:first] = [None] * (first - released[g])
                released[g] = first

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Roll a request back to `num_tokens` slots: free the tail blocks that only rejected drafts used.

        Hashed blocks are never among them: a hash covers known tokens only, all below num_tokens. Nor are released
        ones: a window group releases only blocks below the computed tokens.
        """
        keep = blocks_for(num_tokens, self.block_size)
        for table in self.req_blocks.get(request_id, ()):
            if keep < len(table):
                self.pool.free(list(reversed(table[keep:])))
                del table[keep:]

    def free(self, request_id: str) -> None:
        """Release a request's blocks (finished, aborted or preempted)."""
        for table in self.req_blocks.pop(request_id, ()):
            self.pool.free([b for b in reversed(table) if b is not None])
        self._released.pop(request_id, None)
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

    def _hashes(self, request_id: str, token_ids: Sequence[int], extra: bytes | BlockSalt, num_blocks: int) -> list[bytes]:
        """Hashes of the first `num_blocks` full blocks, extended incrementally as the request grows."""
        hashes = self._req_hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            salt = extra if isinstance(extra, bytes) else extra.at(i)
            hashes.append(block_hash(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs], salt))
        return hashes

    def _cache_full(self, request_id: str, tables: list[list[Block | None]], token_ids: Sequence[int],
                    num_tokens: int, extra: bytes | BlockSalt) -> None:
        """Register each group's blocks that will be full once this step's tokens are written."""
        if not self.enable_prefix_caching:
            return
        full = min(num_tokens, len(token_ids)) // self.block_size
        done = self._num_cached.get(request_id, 0)
        if full <= done:
            return
        hashes = self._hashes(request_id, token_ids, extra, full)
        for g, table in enumerate(tables):
            for block, h in zip(table[done:full], hashes[done:full]):
                key = group_key(h, g)
                if block is not None and self.pool.cache(block, key) and self.tier is not None \
                        and self.tier.wants_persist(key):
                    self._persists.append((block.block_id, key))  # written by this step: to disk after it
        self._num_cached[request_id] = full


def group_key(block_hash: bytes, group: int) -> bytes:
    """A block's key in the pool and the KV tier for one group: the same tokens hold other layers' KV in another
    group (the first group's key is the block hash itself)."""
    return block_hash if group == 0 else hashlib.sha256(block_hash + group.to_bytes(2, "little")).digest()
