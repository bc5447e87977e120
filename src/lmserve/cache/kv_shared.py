"""The shared KV tier (`--kv-shared`): blocks one replica computed, read by every replica that points at the same store.

Two backends behind the disk tier's interface (has, wants, read, submit, flush, close, stats), both storing the
disk tier's checked format (cache/kv_disk.py: a header naming the namespace and block hash, signed with an HMAC
under a secret the replicas share, then the bytes), so a replica serves a block only if it is whole, of its own
model, tokenizer and KV layout (the namespace), of the same prefix and salt (the block hash: another API key's
blocks have other names and other hashes), and signed by a replica of this deployment:

- a directory on a shared filesystem (`--kv-shared /mnt/kv`): SharedDirTier, the disk tier's files (atomic
  renames, the secret beside them) with lookups that ask the filesystem, since other processes add files;
- Redis (`--kv-shared redis://host:port/db`): cache/kv_redis.RedisTier, one string per block with a TTL.

A block that fails a check is deleted from the store and counted (`rejected`); its tokens are recomputed.
Both time their reads and writes (SharedStats) for the metrics.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lmserve.cache.kv_disk import DiskStats, DiskTier

log = logging.getLogger(__name__)


@dataclass
class SharedStats(DiskStats):
    """The disk tier's figures, and the store's latency and failures (plain ints, read without a lock)."""

    reads: int = 0  # lookups that fetched a block's bytes (hits, misses and rejected ones)
    read_ns: int = 0
    writes: int = 0  # blocks sent to the store (written, or found there already)
    write_ns: int = 0
    errors: int = 0  # store operations that failed (Redis down or slow); each was a miss or a dropped write


class SharedDirTier(DiskTier):
    """The disk tier on a directory other replicas also write: a block is looked for on disk, not only in the index
    this process built at start, and a block another replica already wrote is not written again."""

    STATS = SharedStats

    def has(self, block_hash: bytes) -> bool:
        name = self.name_of(block_hash)
        if name in self._index:
            return True
        try:
            if os.stat(self._file(name)).st_size != self.file_bytes:
                return False
        except OSError:
            return False
        with self._lock:  # another replica's file: counted against this replica's budget from now on
            self._add(name)
        return True

    def read(self, block_hash: bytes) -> torch.Tensor | None:
        t0 = time.perf_counter_ns()
        try:
            return super().read(block_hash)
        finally:
            self.stats.reads += 1
            self.stats.read_ns += time.perf_counter_ns() - t0

    def _write(self, name: bytes, block_hash: bytes, data: torch.Tensor, dirty: set[Path]) -> None:
        t0 = time.perf_counter_ns()
        try:
            if self._file(name).exists():  # another replica computed it first: index theirs, write nothing
                with self._lock:
                    self._pending.discard(name)
                    self._queued_bytes -= self.block_bytes
                    self._add(name)
                return
            super()._write(name, block_hash, data, dirty)
        finally:
            self.stats.writes += 1
            self.stats.write_ns += time.perf_counter_ns() - t0


def is_redis_url(target: str) -> bool:
    """`--kv-shared` names a Redis server (else a directory)."""
    return target.startswith(("redis://", "rediss://", "unix://"))
