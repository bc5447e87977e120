"""The disk tier: one file per KV block under `--kv-offload-dir`, written off the engine thread, checked on read.

Layout: `DIR/<namespace, 16 hex>/<hash[:2]>/<block hash, 64 hex>.kvb`. The namespace digest names everything the
bytes depend on besides the tokens (cache/kv_tier.py: weights, kernels, KV layout and element type, block size...)
and the block hash names the tokens and everything before them, salt included (cache/kv_cache_manager.block_hash),
so one file is one block of one model for one prefix, and a file can be served to no other key.

A file is a fixed header, then the block's bytes:

    magic "LMSKVBLK" | u32 format version | 32 B namespace digest | 32 B block hash | u64 payload bytes | u32 CRC-32

A read checks all of it (the magic and version, the namespace and hash it asked for, the exact length, no bytes
beyond it, the payload's CRC): a corrupt, truncated or foreign file is deleted and its block recomputed, never
served. CRC-32 because it guards against accidents (a torn write, a bad sector, a file copied from elsewhere)
and runs at ~1 GB/s where SHA-256 ran at 118 MB/s on this machine; a forged file would pass any checksum, so
the directory must be writable by the server alone (it is created 0700).

Writes go through a bounded queue to one writer thread: header and payload into a temporary file, fdatasync,
rename over the final name, then the directory entry synced once per batch. A crash leaves whole files or
temporary ones (removed at the next start), never a torn file under a block's name. The queue is bounded in
bytes: when the disk cannot keep up, blocks are dropped (counted), never waited for. The least recently used
files beyond `--kv-offload-disk-size` are deleted; their order survives a restart as the files' mtimes (a read
touches its file).
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAGIC = b"LMSKVBLK"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sI32s32sQI")  # magic, version, namespace digest, block hash, payload bytes, CRC-32
SUFFIX = ".kvb"
QUEUE_BYTES = 256 * 2**20  # blocks waiting to be written; beyond it new ones are dropped
STALE_TMP_S = 600.0  # a temporary file this old is a crashed writer's (a live one renames within seconds)


@dataclass
class DiskStats:
    """What the disk tier did since start (read without a lock: plain ints)."""

    used_bytes: int = 0  # files this tier holds
    files: int = 0
    stores: int = 0  # blocks written
    store_bytes: int = 0
    loads: int = 0  # blocks read and verified
    load_bytes: int = 0
    rejected: int = 0  # files refused on read (corrupt, truncated, foreign) and deleted
    dropped: int = 0  # blocks not written: the queue was full
    failed: int = 0  # writes that failed (disk full, permissions...)
    evicted: int = 0  # files deleted to stay within the size


class DiskTier:
    """Block files of one namespace: an index in memory, reads on the caller's thread, writes on its own."""

    def __init__(self, root: Path, namespace: bytes, block_bytes: int, budget_bytes: int,
                 queue_bytes: int = QUEUE_BYTES) -> None:
        self.namespace, self.block_bytes, self.budget = namespace, block_bytes, budget_bytes
        self.file_bytes = HEADER.size + block_bytes
        self.dir = Path(root) / namespace.hex()[:16]
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.stats = DiskStats()
        self._lock = threading.Lock()  # the index and the pending set: the engine thread reads, the writer writes
        self._index: OrderedDict[bytes, None] = OrderedDict()  # block hash -> (), least recently used first
        self._pending: set[bytes] = set()  # queued, not yet written
        self._queue: queue.Queue = queue.Queue()
        self._queue_limit, self._queued_bytes = queue_bytes, 0
        self._closed = False
        self._scan()
        self._thread = threading.Thread(target=self._run, name="lmserve-kv-disk", daemon=True)
        self._thread.start()

    # -- the engine thread ------------------------------------------------------------------------

    def has(self, block_hash: bytes) -> bool:
        """A file for this block exists (as far as this process knows; another may have deleted it)."""
        return block_hash in self._index

    def wants(self, block_hash: bytes) -> bool:
        """Neither written nor queued: worth a copy."""
        with self._lock:
            return block_hash not in self._index and block_hash not in self._pending

    def read(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's bytes ([block_bytes] uint8) if its file is whole and ours; else None (a bad file is deleted)."""
        path = self._path(block_hash)
        payload = torch.empty(self.block_bytes, dtype=torch.uint8)
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                n = f.readinto(memoryview(payload.numpy()))
                trailing = f.read(1)
        except FileNotFoundError:  # deleted by another process sharing the directory: a plain miss
            self._forget(block_hash)
            return None
        except OSError as e:
            self._reject(block_hash, path, f"unreadable ({e.strerror})")
            return None
        why = self._check(head, block_hash, n, trailing, payload)
        if why:
            self._reject(block_hash, path, why)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        self._queue.put(("touch", block_hash, None))  # its mtime keeps the use order across restarts
        self.stats.loads += 1
        self.stats.load_bytes += self.block_bytes
        return payload

    def submit(self, items: list[tuple[bytes, torch.Tensor]]) -> None:
        """Queue blocks ([block_bytes] uint8 CPU tensors, not written to afterwards) for writing; never blocks."""
        for block_hash, data in items:
            with self._lock:
                if self._closed or block_hash in self._index or block_hash in self._pending:
                    continue
                if self._queued_bytes + self.block_bytes > self._queue_limit:
                    self.stats.dropped += 1
                    continue
                self._pending.add(block_hash)
                self._queued_bytes += self.block_bytes
            self._queue.put(("write", block_hash, data))

    def flush(self) -> None:
        """Wait until every queued block is written (tests, and a clean stop)."""
        if not self._closed:
            self._queue.join()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (for at most `timeout_s`), then stop the writer; later blocks are not written."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("KV disk tier: %d blocks not yet written after %.0f s; dropped", len(self._pending), timeout_s)

    # -- checks -----------------------------------------------------------------------------------

    def _check(self, head: bytes, block_hash: bytes, n: int | None, trailing: bytes, payload: torch.Tensor) -> str:
        """Why a file read back is not this block ('' when it is)."""
        if len(head) < HEADER.size:
            return "truncated header"
        magic, version, namespace, stored_hash, length, crc = HEADER.unpack(head)
        if magic != MAGIC or version != FORMAT_VERSION:
            return "not a block file of this format"
        if namespace != self.namespace or stored_hash != block_hash:
            return "a block of another model, layout or prefix"
        if length != self.block_bytes or n != self.block_bytes or trailing:
            return "wrong length"
        if zlib.crc32(memoryview(payload.numpy())) != crc:
            return "checksum mismatch"
        return ""

    def _reject(self, block_hash: bytes, path: Path, why: str) -> None:
        log.warning("KV disk tier: %s is %s; deleted, its tokens are recomputed", path.name, why)
        self.stats.rejected += 1
        self._forget(block_hash)
        _unlink(path)

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            if block_hash in self._index:
                del self._index[block_hash]
                self.stats.files -= 1
                self.stats.used_bytes -= self.file_bytes

    # -- the writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        dirty: set[Path] = set()  # directories whose new entries are not yet synced
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                kind, block_hash, data = job
                try:
                    if kind == "write":
                        self._write(block_hash, data, dirty)
                    else:
                        _touch(self._path(block_hash))
                except Exception:  # a bug must not end the writer (its queue would then fill and never drain)
                    log.exception("KV disk tier: %s of %s failed", kind, block_hash.hex()[:16])
                    with self._lock:
                        if kind == "write" and block_hash in self._pending:
                            self._pending.discard(block_hash)
                            self._queued_bytes -= self.block_bytes
                if self._queue.empty():
                    for d in dirty:
                        _sync_dir(d)
                    dirty.clear()
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, data: torch.Tensor, dirty: set[Path]) -> None:
        path = self._path(block_hash)
        payload = memoryview(data.numpy())
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, FORMAT_VERSION, self.namespace, block_hash, len(payload),
                                    zlib.crc32(payload)))
                f.write(payload)
                f.flush()
                os.fdatasync(f.fileno()) if hasattr(os, "fdatasync") else os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            self.stats.failed += 1
            if self.stats.failed == 1 or self.stats.failed % 1000 == 0:
                log.warning("KV disk tier: cannot write %s (%s); %d writes failed so far", path, e, self.stats.failed)
            _unlink(tmp)
            with self._lock:
                self._pending.discard(block_hash)
                self._queued_bytes -= self.block_bytes
            return
        dirty.add(path.parent)
        with self._lock:
            self._pending.discard(block_hash)
            self._queued_bytes -= self.block_bytes
            self._add(block_hash)
            victims = self._over_budget()
        self.stats.stores += 1
        self.stats.store_bytes += self.block_bytes
        for victim in victims:
            _unlink(self._path(victim))

    def _add(self, block_hash: bytes) -> None:
        """Index a file (the lock held)."""
        if block_hash not in self._index:
            self.stats.files += 1
            self.stats.used_bytes += self.file_bytes
        self._index[block_hash] = None
        self._index.move_to_end(block_hash)

    def _over_budget(self) -> list[bytes]:
        """Drop the least recently used files beyond the budget from the index (the lock held); returns them."""
        victims = []
        while self.stats.used_bytes > self.budget and self._index:
            victim, _ = self._index.popitem(last=False)
            self.stats.files -= 1
            self.stats.used_bytes -= self.file_bytes
            self.stats.evicted += 1
            victims.append(victim)
        return victims

    # -- start-up ---------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the files a previous run left, oldest use first; clear crashed writers' temporary files."""
        found = []
        now = time.time()
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                name = entry.name
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_TMP_S:
                        _unlink(Path(entry.path))
                    continue
                block_hash = _hash_of(name)
                if block_hash is not None and st.st_size == self.file_bytes:
                    found.append((st.st_mtime_ns, block_hash))
                elif block_hash is not None:  # a block of another size under this namespace: never readable
                    _unlink(Path(entry.path))
        found.sort()
        with self._lock:
            for _, block_hash in found:
                self._add(block_hash)
            victims = self._over_budget()
        for victim in victims:
            _unlink(self._path(victim))

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / (name + SUFFIX)


def _hash_of(name: str) -> bytes | None:
    """The block hash a file name stands for, or None for a name that is not a block file's."""
    if not name.endswith(SUFFIX) or len(name) != 64 + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:64])
    except ValueError:
        return None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def _sync_dir(path: Path) -> None:
    """Make the renames into `path` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
