"""The disk tier: one file per KV block under `--kv-offload-dir`, written off the engine thread, checked on read.

Layout: `DIR/<namespace, 16 hex>/<name[:2]>/<name, 64 hex>.kvb`, beside `DIR/.kv-tier-secret`. The namespace
digest names everything the bytes depend on besides the tokens (cache/kv_tier.py: weights, kernels, KV layout and
element type, block size...) and the block hash names the tokens and everything before them, salt included
(cache/kv_cache_manager.block_hash), so one file is one block of one model for one prefix, served to no other key.

A file is a fixed header, then the block's bytes:

    magic "LMSKVBLK" | u32 format version | 32 B namespace digest | 32 B block hash | u64 payload bytes | 32 B MAC

The MAC is an HMAC-SHA256, keyed by this install's secret, of the header before it and the payload; a file's name
is an HMAC of its namespace and block hash under another key derived from the same secret. Block hashes are
public (anyone can hash tokens and a key's name), so without the secret nobody can tell which file a prefix
would be read from, nor write one the server accepts (issue 47: blocks planted under another key's names changed
its greedy answer). The secret lives in the tier's directory (0600, made on first use), so it covers exactly the
files beside it: deleting the directory deletes both, and a copied directory keeps its blocks readable.

A read checks all of it (the magic and version, the namespace and hash it asked for, the exact length, no bytes
beyond it, the MAC): a corrupt, truncated, foreign or forged file is deleted, counted (`rejected`) and its block
recomputed, never served. HMAC-SHA256 runs at ~1.7 GB/s on a CPU with SHA extensions (0.22 ms for a 360 KiB block
of the embedded model), against the ~50 ms that recomputing its 16 tokens costs on 2 cores (kv_tier_ttft.md).

The directories are 0700 and lmserve's alone: an existing one that every user may write, or another user's, is
refused at start. Files are opened with O_NOFOLLOW (a symlink planted at a block's name is refused, not read
through) and written through a temporary file of an unpredictable name created O_EXCL | O_NOFOLLOW, 0600.

Writes go through a bounded queue to one writer thread: header and payload into a temporary file, fdatasync,
rename over the final name, then the directory entry synced once per batch. A crash leaves whole files or
temporary ones (removed at the next start), never a torn file under a block's name. The queue is bounded in
bytes: when the disk cannot keep up, blocks are dropped (counted), never waited for. The least recently used
files beyond `--kv-offload-disk-size` are deleted; their order survives a restart as the files' mtimes (a read
touches its file).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from lmserve.files import create_private, open_nofollow, private_dir, read_secret, temporary_name

log = logging.getLogger(__name__)

MAGIC = b"LMSKVBLK"
FORMAT_VERSION = 2  # 1: CRC-32 and names that were the block hash
HEADER = struct.Struct("<8sI32s32sQ32s")  # magic, version, namespace digest, block hash, payload bytes, MAC
SIGNED = struct.Struct("<8sI32s32sQ")  # the header before its MAC
SUFFIX = ".kvb"
SECRET = ".kv-tier-secret"  # in the tier's root directory: 32 random bytes, 0600
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
    rejected: int = 0  # files refused on read (corrupt, truncated, foreign, forged) and deleted
    dropped: int = 0  # blocks not written: the queue was full
    failed: int = 0  # writes that failed (disk full, permissions...)
    evicted: int = 0  # files deleted to stay within the size


class BlockSeal:
    """One namespace's blocks named and signed under an install's secret: the checked format every tier stores."""

    def __init__(self, secret: bytes, namespace: bytes, block_bytes: int) -> None:
        self.namespace, self.block_bytes = namespace, block_bytes
        self._name_key = hmac.digest(secret, b"lmserve kv-tier file name", "sha256")
        self._mac_key = hmac.digest(secret, b"lmserve kv-tier block mac", "sha256")

    def name_of(self, block_hash: bytes) -> bytes:
        """The 32-byte digest a block is stored under: unpredictable without the secret."""
        return hmac.digest(self._name_key, self.namespace + block_hash, "sha256")

    def header(self, block_hash: bytes, payload: memoryview) -> bytes:
        """The signed header that goes before a block's bytes."""
        signed = SIGNED.pack(MAGIC, FORMAT_VERSION, self.namespace, block_hash, len(payload))
        return signed + self.mac(signed, payload)

    def check(self, head: bytes, block_hash: bytes, n: int | None, trailing: bytes, payload: torch.Tensor) -> str:
        """Why a block read back is not this block ('' when it is)."""
        if len(head) < HEADER.size:
            return "truncated header"
        magic, version, namespace, stored_hash, length, mac = HEADER.unpack(head)
        if magic != MAGIC or version != FORMAT_VERSION:
            return "not a block file of this format"
        if namespace != self.namespace or stored_hash != block_hash:
            return "a block of another model, layout or prefix"
        if length != self.block_bytes or n != self.block_bytes or trailing:
            return "wrong length"
        if not hmac.compare_digest(self.mac(head[:SIGNED.size], memoryview(payload.numpy())), mac):
            return "not signed by this install (forged or corrupt)"
        return ""

    def mac(self, signed_header: bytes, payload: memoryview) -> bytes:
        """HMAC-SHA256 of the header before the MAC and the payload (hashlib drops the GIL for large inputs)."""
        m = hmac.new(self._mac_key, signed_header, hashlib.sha256)
        m.update(payload)
        return m.digest()


class DiskTier:
    """Block files of one namespace: an index in memory, reads on the caller's thread, writes on its own."""

    STATS = DiskStats

    def __init__(self, root: Path, namespace: bytes, block_bytes: int, budget_bytes: int,
                 queue_bytes: int = QUEUE_BYTES) -> None:
        self.namespace, self.block_bytes, self.budget = namespace, block_bytes, budget_bytes
        self.file_bytes = HEADER.size + block_bytes
        root = private_dir(Path(root), own=True)  # PermissionError: everyone's or another user's directory
        self.seal = BlockSeal(read_secret(root / SECRET), namespace, block_bytes)
        self.dir = private_dir(root / namespace.hex()[:16], own=True)
        self.stats = self.STATS()
        self._lock = threading.Lock()  # the index and the pending set: the engine thread reads, the writer writes
        self._index: OrderedDict[bytes, None] = OrderedDict()  # file name digest -> (), least recently used first
        self._pending: set[bytes] = set()  # file name digests queued, not yet written
        self._queue: queue.Queue = queue.Queue()
        self._queue_limit, self._queued_bytes = queue_bytes, 0
        self._closed = False
        self._scan()
        self._thread = threading.Thread(target=self._run, name="lmserve-kv-disk", daemon=True)
        self._thread.start()

    # -- the engine thread ------------------------------------------------------------------------

    def has(self, block_hash: bytes) -> bool:
        """A file for this block exists (as far as this process knows; another may have deleted it)."""
        return self.name_of(block_hash) in self._index

    def name_of(self, block_hash: bytes) -> bytes:
        """The 32-byte digest a block's file is named by: unpredictable without this install's secret."""
        return self.seal.name_of(block_hash)

    def wants(self, block_hash: bytes) -> bool:
        """Neither written nor queued: worth a copy."""
        name = self.name_of(block_hash)
        with self._lock:
            return name not in self._index and name not in self._pending

    def read(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's bytes ([block_bytes] uint8) if its file is whole and ours; else None (a bad file is deleted)."""
        name = self.name_of(block_hash)
        path = self._file(name)
        payload = torch.empty(self.block_bytes, dtype=torch.uint8)
        try:
            with open_nofollow(path) as f:
                head = f.read(HEADER.size)
                n = f.readinto(memoryview(payload.numpy()))
                trailing = f.read(1)
        except FileNotFoundError:  # deleted by another process sharing the directory: a plain miss
            self._forget(name)
            return None
        except OSError as e:  # a symlink at the name is ELOOP: refused, and the link (not its target) deleted
            self._reject(name, path, f"unreadable ({e.strerror})")
            return None
        why = self.seal.check(head, block_hash, n, trailing, payload)
        if why:
            self._reject(name, path, why)
            return None
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
        self._queue.put(("touch", name, None))  # its mtime keeps the use order across restarts
        self.stats.loads += 1
        self.stats.load_bytes += self.block_bytes
        return payload

    def submit(self, items: list[tuple[bytes, torch.Tensor]]) -> None:
        """Queue blocks ([block_bytes] uint8 CPU tensors, not written to afterwards) for writing; never blocks."""
        for block_hash, data in items:
            name = self.name_of(block_hash)
            with self._lock:
                if self._closed or name in self._index or name in self._pending:
                    continue
                if self._queued_bytes + self.block_bytes > self._queue_limit:
                    self.stats.dropped += 1
                    continue
                self._pending.add(name)
                self._queued_bytes += self.block_bytes
            self._queue.put(("write", name, (block_hash, data)))

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

    def _reject(self, name: bytes, path: Path, why: str) -> None:
        log.warning("KV disk tier: %s is %s; deleted, its tokens are recomputed", path.name, why)
        self.stats.rejected += 1
        self._forget(name)
        _unlink(path)

    def _forget(self, name: bytes) -> None:
        with self._lock:
            if name in self._index:
                del self._index[name]
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
                kind, name, data = job
                try:
                    if kind == "write":
                        self._write(name, *data, dirty)
                    else:
                        _touch(self._file(name))
                except Exception:  # a bug must not end the writer (its queue would then fill and never drain)
                    log.exception("KV disk tier: %s of %s failed", kind, name.hex()[:16])
                    with self._lock:
                        if kind == "write" and name in self._pending:
                            self._pending.discard(name)
                            self._queued_bytes -= self.block_bytes
                if self._queue.empty():
                    for d in dirty:
                        _sync_dir(d)
                    dirty.clear()
            finally:
                self._queue.task_done()

    def _write(self, name: bytes, block_hash: bytes, data: torch.Tensor, dirty: set[Path]) -> None:
        path = self._file(name)
        payload = memoryview(data.numpy())
        tmp = temporary_name(path)  # unpredictable, created O_EXCL | O_NOFOLLOW: nothing planted is written through
        try:
            path.parent.mkdir(exist_ok=True, mode=0o700)
            with os.fdopen(create_private(tmp), "wb") as f:
                f.write(self.seal.header(block_hash, payload))
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
                self._pending.discard(name)
                self._queued_bytes -= self.block_bytes
            return
        dirty.add(path.parent)
        with self._lock:
            self._pending.discard(name)
            self._queued_bytes -= self.block_bytes
            self._add(name)
            victims = self._over_budget()
        self.stats.stores += 1
        self.stats.store_bytes += self.block_bytes
        for victim in victims:
            _unlink(self._file(victim))

    def _add(self, name: bytes) -> None:
        """Index a file (the lock held)."""
        if name not in self._index:
            self.stats.files += 1
            self.stats.used_bytes += self.file_bytes
        self._index[name] = None
        self._index.move_to_end(name)

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
            if sub.is_symlink() or not sub.is_dir():  # ours are real directories; a link's files are not read
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
                digest = _digest_of(name)
                if digest is not None and st.st_size == self.file_bytes:
                    found.append((st.st_mtime_ns, digest))
                elif digest is not None:  # a block of another size under this namespace: never readable
                    _unlink(Path(entry.path))
        found.sort()
        with self._lock:
            for _, digest in found:
                self._add(digest)
            victims = self._over_budget()
        for victim in victims:
            _unlink(self._file(victim))

    def _path(self, block_hash: bytes) -> Path:
        """Where a block's file is."""
        return self._file(self.name_of(block_hash))

    def _file(self, name: bytes) -> Path:
        text = name.hex()
        return self.dir / text[:2] / (text + SUFFIX)


def _digest_of(name: str) -> bytes | None:
    """The name digest a file name stands for, or None for a name that is not a block file's."""
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
