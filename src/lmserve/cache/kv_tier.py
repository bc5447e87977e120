"""The KV tier below the pool: prefix-cache blocks kept in host memory, on disk and in a store replicas share,
loaded back on a prefix hit.

Three tiers, each optional (config.KVOffloadConfig):
- host (`--kv-offload-memory`): the blocks the pool evicts. When the pool hands a cached block to new
  tokens, its old KV is copied out first (before the step's forward overwrites it) into an LRU bounded in bytes.
- disk (`--kv-offload-dir`, cache/kv_disk.py): every full prefix block, once, written after the step that
  computed it (write-through, as LMCache's disk backend does), so a long system prompt survives a restart or a
  crash, not only the blocks that happened to be evicted before a clean stop.
- shared (`--kv-shared`, cache/kv_shared.py): the disk tier's write-through and checks on a store every replica
  reads (Redis, or a directory on a shared filesystem), so a prompt one replica computed is a hit on the others.

A prefix lookup (KVCacheManager.find_computed) walks the pool first, then the tier: a block found in the tier
is staged here (host: the tensor itself; disk: read and checked now, on the engine thread, so a bad file is
refused before any token counts as computed), the manager gives it a fresh pool block and publishes its hash,
and the runner copies the bytes in before the step's forward (worker/kv_transfer.py). The scheduler counts
those tokens as computed, exactly as for a pool hit.

Everything is keyed by the block's prefix hash (which already holds the request's cache salt: per key, per
adapter), mixed with its KV group's index for a model with several groups (cache/kv_groups.py: the same tokens
hold other layers' KV in each group; the pool's own key, kv_cache_manager.group_key), inside a namespace that names what else the bytes depend on: the weights' fingerprint, their format
and dtype, the kernels that computed them, the tokenizer, the KV layout and element types, the block size.
A tier never hands one namespace's bytes to another, nor a salted block to another salt.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from lmserve.cache.kv_disk import FORMAT_VERSION, DiskTier
from lmserve.cache.kv_shared import SharedDirTier, is_redis_url
from lmserve.config import KVOffloadConfig
from lmserve.files import write_private

log = logging.getLogger(__name__)


@dataclass
class TierCounters:
    """Blocks moved through one tier since start."""

    loads: int = 0  # blocks copied from this tier into the pool (of every KV group)
    hit_tokens: int = 0  # prompt tokens those loads served (a model's first group's blocks: block_size tokens each)
    load_bytes: int = 0
    stores: int = 0  # blocks copied into this tier (the disk tier's writer counts its own: DiskStats)
    store_bytes: int = 0


class HostTier:
    """Whole blocks in host memory, least recently used dropped first, bounded in bytes."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._blocks)

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        data = self._blocks.get(block_hash)
        if data is not None:
            self._blocks.move_to_end(block_hash)
        return data

    def touch(self, block_hash: bytes) -> None:
        self._blocks.move_to_end(block_hash)

    def put(self, block_hash: bytes, data: torch.Tensor) -> bool:
        """Keep a block (a tensor of its own: a view would pin its whole batch); False when it cannot fit."""
        if data.nbytes > self.budget:
            return False
        old = self._blocks.pop(block_hash, None)
        if old is not None:
            self.used_bytes -= old.nbytes
        while self._blocks and self.used_bytes + data.nbytes > self.budget:
            _, evicted = self._blocks.popitem(last=False)
            self.used_bytes -= evicted.nbytes
        self._blocks[block_hash] = data
        self.used_bytes += data.nbytes
        return True


class KVTier:
    """The tiers below one engine's pool: what the KV cache manager asks and what the runner's copies feed."""

    def __init__(self, block_bytes: int, block_size: int, host_bytes: int = 0, disk: DiskTier | None = None,
                 shared=None) -> None:
        self.block_bytes, self.block_size = block_bytes, block_size
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.disk = disk
        self.shared = shared  # SharedDirTier or kv_redis.RedisTier: the disk tier's interface on a shared store
        self.counters = {"host": TierCounters(), "disk": TierCounters(), "shared": TierCounters()}
        # block key -> (bytes, tier, prompt tokens it serves), until loaded
        self._staged: dict[bytes, tuple[torch.Tensor, str, int]] = {}

    # -- the scheduler's side (engine thread) -----------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        """The block can be loaded from some tier (a disk file or shared block is only checked when staged)."""
        return (self.host is not None and self.host.has(block_hash)) or any(
            store is not None and store.has(block_hash) for store in (self.disk, self.shared))

    def stage(self, hashes: list[bytes], counted: int | None = None) -> bool:
        """Fetch these blocks' bytes for the next step's loads; False (nothing staged) when one cannot be read.

        The first `counted` blocks (default: all) count as block_size prompt tokens served once loaded: with several
        KV groups, one group's blocks stand for the tokens, the others' are the same tokens in other layers.
        A disk file that fails its checks is deleted here, so the caller's next lookup stops before it.
        """
        counted = len(hashes) if counted is None else counted
        fetched = []
        for i, h in enumerate(hashes):
            found = self._fetch(h)
            if found is None:
                return False
            fetched.append((h, (*found, self.block_size if i < counted else 0)))
        self._staged.update(fetched)
        return True

    def _fetch(self, block_hash: bytes) -> tuple[torch.Tensor, str] | None:
        if self.host is not None:
            data = self.host.get(block_hash)
            if data is not None:
                return data, "host"
        for tier, store in (("disk", self.disk), ("shared", self.shared)):
            if store is not None and store.has(block_hash):
                data = store.read(block_hash)
                if data is not None:
                    return data, tier
        return None

    def unstage_all(self) -> None:
        """Forget staged blocks whose load never ran (a failed step)."""
        self._staged.clear()

    def wants_save(self, block_hash: bytes) -> bool:
        """An evicted block worth copying to host memory: the host tier is on and does not hold it yet."""
        if self.host is None:
            return False
        if self.host.has(block_hash):
            self.host.touch(block_hash)  # evicted again: recently used
            return False
        return True

    def wants_persist(self, block_hash: bytes) -> bool:
        """A newly computed block worth writing to disk or the shared store: one of them is on and has neither it
        nor it queued."""
        return any(store is not None and store.wants(block_hash) for store in (self.disk, self.shared))

    # -- the runner's side (the copies; engine thread) --------------------------------------------

    def take_staged(self, block_hash: bytes) -> torch.Tensor:
        """A staged block's bytes, counted as loaded from its tier."""
        data, tier, tokens = self._staged.pop(block_hash)
        c = self.counters[tier]
        c.loads += 1
        c.load_bytes += data.nbytes
        c.hit_tokens += tokens
        return data

    def save(self, items: list[tuple[bytes, torch.Tensor]]) -> None:
        """Evicted blocks into host memory (each tensor its own copy)."""
        c = self.counters["host"]
        for block_hash, data in items:
            if self.host.put(block_hash, data):
                c.stores += 1
                c.store_bytes += data.nbytes

    def persist(self, items: list[tuple[bytes, torch.Tensor]]) -> None:
        """Newly computed blocks onto the disk's and the shared store's writer queues (each skips what it holds or
        has queued, and counts what it writes)."""
        for store in (self.disk, self.shared):
            if store is not None:
                store.submit(items)

    # -- stats and life cycle ---------------------------------------------------------------------

    def stats(self, tier: str) -> dict[str, int]:
        """One tier's figures since start (host | disk | shared): hit tokens, blocks and bytes loaded and stored,
        bytes held."""
        c = self.counters[tier]
        out = {"hit_tokens": c.hit_tokens, "loads": c.loads, "load_bytes": c.load_bytes}
        if tier == "host":
            held = self.host.used_bytes if self.host is not None else 0
            return out | {"stores": c.stores, "store_bytes": c.store_bytes, "used_bytes": held}
        store = self.disk if tier == "disk" else self.shared
        d = store.stats if store is not None else None
        return out | {"stores": d.stores if d else 0, "store_bytes": d.store_bytes if d else 0,
                      "used_bytes": d.used_bytes if d else 0}

    def summary(self) -> dict[str, dict[str, int]]:
        """stats() of each tier this has (host, disk); the disk's with the files it refused, dropped and failed."""
        out = {"host": self.stats("host")} if self.host is not None else {}
        if self.disk is not None:
            d = self.disk.stats
            out["disk"] = self.stats("disk") | {"rejected": d.rejected, "dropped": d.dropped, "failed": d.failed}
        if self.shared is not None:
            s = self.shared.stats
            out["shared"] = self.stats("shared") | {
                "rejected": s.rejected, "dropped": s.dropped, "failed": s.failed, "errors": s.errors,
                "reads": s.reads, "read_ns": s.read_ns, "writes": s.writes, "write_ns": s.write_ns}
        return out

    def flush(self) -> None:
        """Wait until the disk and shared writers have written everything queued."""
        for store in (self.disk, self.shared):
            if store is not None:
                store.flush()

    def close(self) -> None:
        """Write what is queued (bounded in time) and stop the writers."""
        for store in (self.disk, self.shared):
            if store is not None:
                store.close()


def namespace(identity: dict[str, str]) -> bytes:
    """The 32-byte digest of everything a block's bytes depend on besides its tokens."""
    text = json.dumps({"tier_format": FORMAT_VERSION, **identity}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()


def open_kv_tier(cfg: KVOffloadConfig, identity: dict[str, str], block_bytes: int, block_size: int) -> KVTier:
    """The tiers `cfg` asks for; the disk tier's (and a shared one's) directory is made (0700) and indexed now
    (PermissionError: the directory is every user's or another user's, or its secret is not private)."""
    disk = None
    ns = namespace(identity)
    if cfg.directory is not None:
        disk = DiskTier(Path(cfg.directory).expanduser(), ns, block_bytes, cfg.disk_bytes)
        note = disk.dir / "identity.json"  # what this namespace's blocks are, for whoever looks into the directory
        if not note.exists():
            write_private(note, json.dumps(identity, indent=1, sort_keys=True).encode())
    if 0 < cfg.memory_bytes < block_bytes:
        log.warning("--kv-offload-memory %d bytes holds not one KV block (%d bytes); the host tier stays empty",
                    cfg.memory_bytes, block_bytes)
    return KVTier(block_bytes, block_size, cfg.memory_bytes, disk, open_shared(cfg, identity, ns, block_bytes))


def open_shared(cfg: KVOffloadConfig, identity: dict[str, str], ns: bytes, block_bytes: int):
    """The shared store `--kv-shared` names (None: off): a Redis URL -> kv_redis.RedisTier (blocks expire
    `--kv-shared-ttl` after their last use), else a directory -> SharedDirTier (bounded by `--kv-shared-size`)."""
    if cfg.shared is None:
        return None
    if is_redis_url(cfg.shared):
        from lmserve.cache.kv_redis import RedisTier  # imports the redis client: only when asked for

        return RedisTier(cfg.shared, ns, block_bytes, cfg.shared_ttl_s)
    store = SharedDirTier(Path(cfg.shared).expanduser(), ns, block_bytes, cfg.shared_bytes)
    note = store.dir / "identity.json"
    if not note.exists():
        write_private(note, json.dumps(identity, indent=1, sort_keys=True).encode())
    return store
