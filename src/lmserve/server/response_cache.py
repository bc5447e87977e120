"""Exact-match response cache for deterministic requests (`--response-cache`), in SQLite or Redis.

A request is cached only when its answer is a function of its body: greedy (temperature 0) or seeded
sampling. The key is a SHA-256 of what answers (the served model's name and a fingerprint of its weights as
loaded; a LoRA adapter's content digest, never just its name, so a replaced or reloaded adapter never answers
from its predecessor's entries), the caller's API key *name* (entries are never shared across keys) and the
body with the fields that do not change the answer (those its protocol model marks: server/protocol.py
ANSWER_NEUTRAL) left out, keys sorted. The value is the complete JSON response; a streamed request
with a hit gets it replayed as a stream (`server/api/cache_replay.py`). Only non-streamed responses are
stored: a stream's pieces are not kept.

Each key holds at most its share of the entries (StorageQuota.cache_entries; by default the cache's size split
equally among the keys): a key at its share makes room from its own oldest entries, so one key's flood of new
requests never evicts another key's answers. The oldest entries overall go only when the shares add up to more
than `max_entries`.

The cache never fails a request: a backend error (Redis down, a locked file) is logged, at most once a
minute, and the request goes to the model as a miss. Backend calls run off the event loop with short
timeouts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Protocol

from lmserve.files import open_sqlite, user_cache_dir
from lmserve.loader.fingerprint import served_fingerprint
from lmserve.server.metrics import ServerMetrics

if TYPE_CHECKING:
    import torch

    from lmserve.loader import LoadedModel

log = logging.getLogger("lmserve.server")

_WARN_EVERY_S = 60.0


class Backend(Protocol):
    """Where entries live: bytes by key, each with a time to live."""

    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, value: bytes, owner: str = "", owner_cap: int | None = None) -> None: ...
    def count(self) -> int: ...


@dataclass(frozen=True)
class CacheSettings:
    """`--response-cache URL`, `--response-cache-ttl`, `--response-cache-max-entries`."""

    url: str
    ttl: float = 3600.0
    max_entries: int = 10_000


def default_sqlite_path() -> Path:
    """$XDG_CACHE_HOME/lmserve/responses.sqlite (~/.cache/... when unset): a cache, safe to delete."""
    return user_cache_dir() / "responses.sqlite"


def open_backend(settings: CacheSettings) -> Backend:
    """'sqlite' / 'sqlite:PATH' / 'redis://HOST:PORT/DB' -> a backend; ValueError for anything else."""
    url = settings.url
    if url == "sqlite" or url.startswith("sqlite:"):
        path = Path(url.partition(":")[2] or default_sqlite_path())
        return SqliteBackend(path, settings.ttl, settings.max_entries)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisBackend(url, settings.ttl, settings.max_entries)
    raise ValueError(f"--response-cache must be 'sqlite', 'sqlite:PATH' or 'redis://HOST:PORT/DB', got {url!r}")


class SqliteBackend:
    """One table; an owner's oldest go past its cap, the oldest of all past `max_entries`; expired ones are skipped
    and swept."""

    def __init__(self, path: Path, ttl: float, max_entries: int) -> None:
        self.ttl, self.max_entries = ttl, max_entries
        self._lock = threading.Lock()  # one connection shared by the thread pool's threads
        self._db = open_sqlite(path, (  # 0600 in a 0700 directory, as every file the server stores
            "DROP TABLE IF EXISTS entries",  # before entries had owners: a cache, safe to drop
            "CREATE TABLE IF NOT EXISTS owned_entries (key TEXT PRIMARY KEY, value BLOB NOT NULL, "
            "expires REAL NOT NULL, created REAL NOT NULL, owner TEXT NOT NULL)",
            "CREATE INDEX IF NOT EXISTS by_created ON owned_entries (created)",
            "CREATE INDEX IF NOT EXISTS by_owner ON owned_entries (owner, created)"), timeout=1.0)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM owned_entries WHERE key = ? AND expires > ?",
                                   (key, time.time())).fetchone()
        return row[0] if row else None

    def put(self, key: str, value: bytes, owner: str = "", owner_cap: int | None = None) -> None:
        now = time.time()
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO owned_entries VALUES (?, ?, ?, ?, ?)",
                             (key, value, now + self.ttl, now, owner))
            self._db.execute("DELETE FROM owned_entries WHERE expires <= ?", (now,))
            if owner_cap is not None:
                self._db.execute("DELETE FROM owned_entries WHERE key IN (SELECT key FROM owned_entries "
                                 "WHERE owner = ? ORDER BY created DESC LIMIT -1 OFFSET ?)", (owner, owner_cap))
            self._db.execute("DELETE FROM owned_entries WHERE key IN (SELECT key FROM owned_entries ORDER BY created "
                             "DESC LIMIT -1 OFFSET ?)", (self.max_entries,))
            self._db.commit()

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM owned_entries WHERE expires > ?",
                                    (time.time(),)).fetchone()[0]


class RedisBackend:
    """Entries as Redis strings with a TTL; sorted sets by insertion time, one of all entries (members `owner\nkey`)
    and one per owner, trim an owner's oldest past its cap and the oldest of all past `max_entries`."""

    PREFIX = "lmserve:response:"
    INDEX = "lmserve:responses:all"
    OWNER_INDEX = "lmserve:responses:owner:"

    def __init__(self, url: str, ttl: float, max_entries: int) -> None:
        import redis  # only when asked for

        self.ttl, self.max_entries = ttl, max_entries
        self._redis = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)

    def get(self, key: str) -> bytes | None:
        return self._redis.get(self.PREFIX + key)

    def put(self, key: str, value: bytes, owner: str = "", owner_cap: int | None = None) -> None:
        now, mine = time.time(), self.OWNER_INDEX + owner
        pipe = self._redis.pipeline()
        pipe.set(self.PREFIX + key, value, px=max(1, int(self.ttl * 1000)))
        pipe.zadd(self.INDEX, {f"{owner}\n{key}": now})
        pipe.zadd(mine, {key: now})
        pipe.zremrangebyscore(self.INDEX, 0, now - self.ttl)  # expired: Redis has dropped their strings
        pipe.zremrangebyscore(mine, 0, now - self.ttl)
        if owner_cap is not None:
            pipe.zrange(mine, 0, -owner_cap - 1)  # the owner's oldest past its cap
        done = pipe.execute()
        own_oldest = done[-1] if owner_cap is not None else []
        self._drop([f"{owner}\n{k.decode()}".encode() for k in own_oldest])
        self._drop(self._redis.zrange(self.INDEX, 0, -self.max_entries - 1))  # the oldest of all past the limit

    def _drop(self, members: list[bytes]) -> None:
        """Delete entries named as `owner\nkey` index members, from every index."""
        if not members:
            return
        pipe = self._redis.pipeline()
        for member in members:
            owner, _, key = member.decode().rpartition("\n")
            pipe.delete(self.PREFIX + key)
            pipe.zrem(self.OWNER_INDEX + owner, key)
        pipe.zrem(self.INDEX, *members)
        pipe.execute()

    def count(self) -> int:
        return int(self._redis.zcount(self.INDEX, time.time() - self.ttl, "+inf"))


def cacheable(body: dict[str, Any]) -> bool:
    """A request whose answer is fixed by its body: greedy or seeded, and not opted out."""
    if body.get("cache") is False or _fetches_an_image(body):
        return False
    temperature = body.get("temperature", 1.0)
    return temperature == 0 or body.get("seed") is not None


def _fetches_an_image(body: dict[str, Any]) -> bool:
    """Whether the body names an image by http(s) URL (OpenAI's image_url, Responses' input_image, Anthropic's url
    source): its bytes are not in the body, so the body does not fix the answer. data: URLs are in it."""
    stack: list[Any] = [body.get("messages"), body.get("input")]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            for key, v in value.items():
                if key in ("image_url", "url") and isinstance(v, str) and v[:8].lower().startswith(("http://", "https:/")):
                    return True
                if isinstance(v, (dict, list)):
                    stack.append(v)
    return False


def cache_key(model: str, key_name: str, route: str, body: dict[str, Any], ignored: Collection[str] = ()) -> str:
    """SHA-256 over what answers (`model`: see ResponseCache.answerer), the API key's name, the route and the body
    minus the `ignored` fields (those that do not change the answer: server/protocol.py answer_neutral)."""
    kept = {k: v for k, v in body.items() if k not in ignored}
    text = json.dumps([model, key_name, route, kept], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class Weights(Protocol):
    """What the cache fingerprints of a model: its weights as loaded (a model's engine/front.EngineFront)."""

    loaded: LoadedModel  # path and weight format
    dtype: torch.dtype


class ResponseCache:
    """The server's cache: lookups and stores off the event loop; faults logged, never raised."""

    def __init__(self, settings: CacheSettings, metrics: ServerMetrics | None = None) -> None:
        self.settings = settings
        self.backend = open_backend(settings)
        self.metrics = metrics
        self._warned = 0.0
        # a model's front end -> its weights' fingerprint (forgotten with the model when it unloads)
        self._fingerprints: weakref.WeakKeyDictionary[Weights, str] = weakref.WeakKeyDictionary()
        if metrics is not None:
            metrics.bind_response_cache(self._count_or_nan)

    def bind_engine(self, engine: Weights) -> str | None:
        """Fingerprint an engine's weights as it loaded them (blocking: call where it loads, or off the loop);
        None when its files cannot be read now (its requests then bypass the cache)."""
        fp = self._fingerprints.get(engine)
        if fp is None:
            loaded = engine.loaded
            try:
                fp = f"{served_fingerprint(loaded)}:{loaded.weight_format}:{engine.dtype}"
            except OSError as e:
                log.warning("response cache: cannot fingerprint %s (%s); its requests bypass the cache", loaded.path, e)
                return None
            self._fingerprints[engine] = fp
        return fp

    async def answerer(self, model_name: str, engine: Weights, lora_digest: str) -> str | None:
        """What answers, as the cache key names it: the model and its weights' fingerprint, and the adapter's
        content digest ("" for none); None: unknown (do not cache)."""
        fp = self._fingerprints.get(engine) or await asyncio.to_thread(self.bind_engine, engine)
        return None if fp is None else f"{model_name}@{fp}" + (f"+lora:{lora_digest}" if lora_digest else "")

    async def get(self, key: str) -> dict | None:
        """The stored response, or None (a miss, counted; a backend fault counts as a miss)."""
        value = await self._call(self.backend.get, key)
        hit = isinstance(value, bytes)
        if self.metrics is not None:
            (self.metrics.cache_hits if hit else self.metrics.cache_misses).inc()
        return json.loads(value) if hit else None

    async def put(self, key: str, response: dict, owner: str = "", owner_cap: int | None = None) -> None:
        """Store an answer under `key`, for `owner` (an API key's name) who may hold `owner_cap` entries."""
        await self._call(self.backend.put, key, json.dumps(response).encode(), owner, owner_cap)

    async def _call(self, fn, *args) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except Exception as e:  # noqa: BLE001 - a cache fault must never fail the request
            now = time.monotonic()
            if now - self._warned > _WARN_EVERY_S:
                self._warned = now
                log.warning("response cache unavailable (%s: %s); serving from the model", type(e).__name__, e)
            return None

    def _count_or_nan(self) -> float:
        try:
            return float(self.backend.count())
        except Exception:  # noqa: BLE001 - a scrape must not fail because Redis is down
            return float("nan")
