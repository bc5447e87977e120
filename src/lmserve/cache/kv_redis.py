"""The shared KV tier on Redis (`--kv-shared redis://host:port/db`): one string per block, read by every replica.

A block is stored under `lmserve:kv:<namespace, 16 hex>:<name, 64 hex>` as the disk tier's file would be (a
signed header, then the bytes: cache/kv_disk.BlockSeal), the name an HMAC of the namespace and the block hash
under a secret the replicas share. The secret is kept in the same Redis (`lmserve:kv:secret`, set once by the
first replica): Redis's own access control (a password or ACL user in the URL) is the trust boundary, as the
directory's permissions are for the disk tier. Whoever can write this Redis can plant blocks; nobody who cannot
can, and a corrupt, truncated, foreign or other-salt value is refused (deleted, counted), never served.

Bounded by time: each block expires `--kv-shared-ttl` seconds after its last write or read (a read refreshes it),
so a prefix in use stays and an unused one goes without any replica keeping an index of what others wrote. Bound
Redis's memory as well with its own `maxmemory` and `maxmemory-policy volatile-lru` (docs/deployment.md).

Failures degrade to misses: every call has a short socket timeout, and after a failure (Redis down, slow, full)
the tier answers "not here" without asking for RETRY_S, then tries again; the request is computed as if the tier
were off, and the failure is counted (`errors`) and logged once per outage (and once when Redis answers again).
Writes go through a bounded queue to one writer thread (SET NX: a block another replica wrote first is left as
it is), so the engine thread never waits on a write.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict

import torch

from lmserve.cache.kv_disk import HEADER, QUEUE_BYTES, BlockSeal
from lmserve.cache.kv_shared import SharedStats

log = logging.getLogger(__name__)

PREFIX = "lmserve:kv:"
SECRET_KEY = PREFIX + "secret"
TIMEOUT_S = 0.25  # one Redis call; beyond it the block is a miss (recomputing 16 tokens costs ~50 ms on 2 cores)
RETRY_S = 5.0  # after a failure, how long the tier answers misses without asking Redis
SECRET_CHECK_S = 30.0  # how often the secret is read again (a Redis restarted between two calls lost it)


class RedisTier:
    """Blocks of one namespace in Redis: lookups and reads on the caller's thread, writes on the tier's own."""

    def __init__(self, url: str, namespace: bytes, block_bytes: int, ttl_s: float, queue_bytes: int = QUEUE_BYTES,
                 timeout_s: float = TIMEOUT_S) -> None:
        import redis  # only when asked for

        self.url, self.namespace, self.block_bytes = _safe_url(url), namespace, block_bytes
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.value_bytes = HEADER.size + block_bytes
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._error = redis.RedisError
        self._prefix = f"{PREFIX}{namespace.hex()[:16]}:".encode()
        self.stats = SharedStats()
        self._secret: bytes | None = None
        self._checked_at = 0.0  # monotonic time the secret was last read
        self._seal: BlockSeal | None = None
        self._down_until = 0.0  # monotonic time before which the tier does not ask Redis
        self._outage = False  # a failure was logged and no call has worked since
        self._lock = threading.Lock()
        self._written: OrderedDict[bytes, float] = OrderedDict()  # name -> when it expires, as this replica knows
        self._pending: set[bytes] = set()
        self._queue: queue.Queue = queue.Queue()
        self._queue_limit, self._queued_bytes = queue_bytes, 0
        self._closed = False
        if self._ready() is None:
            log.warning("KV shared tier: Redis at %s is not reachable now; its blocks are misses until it is", self.url)
        self._thread = threading.Thread(target=self._run, name="lmserve-kv-redis", daemon=True)
        self._thread.start()

    # -- the engine thread ------------------------------------------------------------------------

    def has(self, block_hash: bytes) -> bool:
        """Redis holds this block now (False while Redis is unreachable)."""
        seal = self._ready()
        if seal is None:
            return False
        try:
            found = bool(self._redis.exists(self._key(seal.name_of(block_hash))))
        except self._error as e:
            self._failed("lookup", e)
            return False
        self._worked()
        return found

    def wants(self, block_hash: bytes) -> bool:
        """Neither queued nor written by this replica within its TTL: worth sending."""
        seal = self._seal
        if seal is None or self._closed:
            return False
        name = seal.name_of(block_hash)
        with self._lock:
            return name not in self._pending and not self._fresh(name, time.monotonic())

    def read(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's bytes ([block_bytes] uint8) if Redis holds it whole and signed; else None (a bad value is
        deleted and counted)."""
        seal = self._ready()
        if seal is None:
            return None
        key = self._key(seal.name_of(block_hash))
        t0 = time.perf_counter_ns()
        try:
            value = self._redis.getex(key, px=self.ttl_ms)  # a read keeps the block another TTL
        except self._error as e:
            self._failed("read", e)
            return None
        finally:
            self.stats.reads += 1
            self.stats.read_ns += time.perf_counter_ns() - t0
        if value is None:  # expired or evicted since the lookup: a plain miss
            return None
        payload = torch.frombuffer(bytearray(memoryview(value)[HEADER.size:]), dtype=torch.uint8) \
            if len(value) >= HEADER.size else torch.empty(0, dtype=torch.uint8)
        why = seal.check(value[:HEADER.size], block_hash, payload.numel(), b"", payload)
        if why:
            self._reject(key, why)
            return None
        self.stats.loads += 1
        self.stats.load_bytes += self.block_bytes
        return payload

    def submit(self, items: list[tuple[bytes, torch.Tensor]]) -> None:
        """Queue blocks ([block_bytes] uint8 CPU tensors, not written to afterwards) for Redis; never blocks."""
        seal = self._seal
        if seal is None:
            return
        now = time.monotonic()
        for block_hash, data in items:
            name = seal.name_of(block_hash)
            with self._lock:
                if self._closed or name in self._pending or self._fresh(name, now):
                    continue
                if self._queued_bytes + self.block_bytes > self._queue_limit:
                    self.stats.dropped += 1
                    continue
                self._pending.add(name)
                self._queued_bytes += self.block_bytes
            self._queue.put((name, block_hash, data))

    def flush(self) -> None:
        """Wait until every queued block is sent (tests, and a clean stop)."""
        if not self._closed:
            self._queue.join()

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued (for at most `timeout_s`), then stop the writer."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._redis.close()

    def _fresh(self, name: bytes, now: float) -> bool:
        """This replica wrote the block less than half a TTL ago (after that, a block computed again is re-sent:
        Redis may have dropped it)."""
        expires = self._written.get(name)
        return expires is not None and expires - self.ttl_ms / 2000 >= now

    # -- Redis ------------------------------------------------------------------------------------

    def _key(self, name: bytes) -> bytes:
        return self._prefix + name.hex().encode()

    def _ready(self) -> BlockSeal | None:
        """The seal, reading the shared secret on first contact, after an outage and every SECRET_CHECK_S; None
        while Redis is (recently) unreachable. This replica offers its own secret first: a Redis restarted empty
        then gets one that running replicas already sign with, and every replica adopts whatever Redis holds."""
        if time.monotonic() < self._down_until:
            return None
        if self._seal is not None and not self._outage and time.monotonic() < self._checked_at + SECRET_CHECK_S:
            return self._seal
        try:
            self._redis.set(SECRET_KEY, self._secret or os.urandom(32), nx=True)  # the first replica's is everyone's
            secret = self._redis.get(SECRET_KEY)
        except self._error as e:
            self._failed("connect", e)
            return None
        if secret is None or len(secret) != 32:
            self._failed("connect", ValueError(f"{SECRET_KEY} holds no 32-byte secret"))
            return None
        self._checked_at = time.monotonic()
        if secret != self._secret or self._outage:  # Redis may have lost what this replica wrote before
            with self._lock:
                self._written.clear()
        if secret != self._secret:
            self._secret, self._seal = secret, BlockSeal(secret, self.namespace, self.block_bytes)
        self._worked()
        return self._seal

    def _failed(self, what: str, e: Exception) -> None:
        """Count a failed call; the first of an outage is logged, and Redis is left alone for RETRY_S."""
        self.stats.errors += 1
        if not self._outage:
            self._outage = True
            log.warning("KV shared tier: Redis %s at %s failed (%s); blocks are computed, not shared, until it "
                        "answers (asked again every %.0f s)", what, self.url, e, RETRY_S)
        self._down_until = time.monotonic() + RETRY_S

    def _worked(self) -> None:
        if self._outage:
            self._outage = False
            log.warning("KV shared tier: Redis at %s answers again; blocks are shared", self.url)

    def _reject(self, key: bytes, why: str) -> None:
        log.warning("KV shared tier: %s is %s; deleted, its tokens are recomputed", key.decode(), why)
        self.stats.rejected += 1
        try:
            self._redis.delete(key)
        except self._error as e:
            self._failed("delete", e)

    # -- the writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(*job)
            except Exception:  # a bug must not end the writer (its queue would then fill and never drain)
                log.exception("KV shared tier: a write failed")
            finally:
                if job is not None:
                    with self._lock:
                        self._pending.discard(job[0])
                        self._queued_bytes -= self.block_bytes
                self._queue.task_done()

    def _write(self, name: bytes, block_hash: bytes, data: torch.Tensor) -> None:
        seal = self._ready()
        if seal is None:
            self.stats.failed += 1
            return
        payload = memoryview(data.numpy())
        t0 = time.perf_counter_ns()
        try:
            # NX: another replica's copy of the same block stays (both are the same bytes, signed alike)
            done = self._redis.set(self._key(name), seal.header(block_hash, payload) + payload.tobytes(),
                                   px=self.ttl_ms, nx=True)
        except self._error as e:
            self.stats.failed += 1
            self._failed("write", e)
            return
        finally:
            self.stats.writes += 1
            self.stats.write_ns += time.perf_counter_ns() - t0
        with self._lock:
            self._written[name] = time.monotonic() + self.ttl_ms / 1000
            self._written.move_to_end(name)
            now = time.monotonic()  # in write order, so expiry order: the stale ones are at the front
            while self._written and (len(self._written) > 1 << 16 or next(iter(self._written.values())) < now):
                self._written.popitem(last=False)
            self.stats.used_bytes = len(self._written) * self.value_bytes  # this replica's blocks, not others'
        if done:
            self.stats.stores += 1
            self.stats.store_bytes += self.block_bytes


def _safe_url(url: str) -> str:
    """The URL without its password, for logs."""
    head, sep, tail = url.rpartition("@")
    return f"{head.split('://')[0]}://…@{tail}" if sep else url
