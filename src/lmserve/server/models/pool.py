"""The server's models by name (`--model NAME=PATH`, repeatable): loaded on demand, the least recently used one
unloaded when a load would pass `--max-loaded-models`, and any one unloaded once idle past its keep-alive
(`--keep-alive`, or the last request's own: Ollama's `keep_alive`), so an idle server scales to zero.

Invariants:
- Loads run one at a time (two checkpoints never load at once: memory is bounded by K loaded models plus none).
- A request that finds its model loading waits for that same load (one load, however many wait), bounded by
  the pool's load timeout: the caller answers 503 + Retry-After then, and the load goes on for the next request.
- A model is unloaded only when no request holds a lease on it (`leases`: from the request's model resolution
  to its response's end), so a request never sees its engine go away; a load that needs room waits for one.
- Keep-alive: a model idle (no lease) for its `keep_alive` seconds is unloaded by `expire_idle`, the pool's one
  background task; None keeps it loaded. Each request sets it (its own, else the pool's default) and the
  clock starts when the last lease ends, as Ollama counts it; 0 unloads as soon as the last response ends.
  A request's own value stays within the operator's bounds (KeepAlive.bound): never past `--keep-alive-max`,
  and never below `--keep-alive` unless its key may unload (an admin, or any key with `--allow-unload`).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from lmserve.config import EngineConfig

if TYPE_CHECKING:
    from lmserve.engine.serving import AsyncEngine

log = logging.getLogger("lmserve.server")
_M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
RELEASE_TRIES, RELEASE_RETRY_S = 20, 0.05  # an unloaded engine still held: collect again, for ~1 s + the collections
_LOOK_S = 5.0  # with --keep-alive, expire_idle looks at least this often (for models it was not woken about)


@dataclass(frozen=True)
class KeepAlive:
    """The operator's keep-alive: what a request naming none gets, and the bounds of one that names its own."""

    default: float | None = None  # --keep-alive seconds; None: kept loaded
    max: float | None = None  # --keep-alive-max: the longest a request may ask for; None: forever
    allow_unload: bool = False  # --allow-unload: any key may shorten it (0: unload), not only admin keys

    def bound(self, seconds: float | None, may_shorten: bool) -> float | None:
        """A request's keep_alive (None: forever) clamped into [default, max], or [0, max] when it `may_shorten`.

        Clamped, not refused: Ollama clients send a keep_alive of their own (-1, "5m") as a habit, and the
        model's real expiry shows in /api/ps. The caller refuses an explicit 0 (an unload) it may not make."""
        if self.max is not None and (seconds is None or seconds > self.max):
            seconds = self.max
        if not may_shorten and seconds is not None and (self.default is None or seconds < self.default):
            seconds = self.default
        return seconds


@dataclass(frozen=True)
class ModelSpec:
    """One configured model: its served name and how to build its engine."""

    name: str
    config: EngineConfig | None = None  # None: its engine is started by the caller and never unloaded
    max_model_len: int | None = None  # from the start-up checks: /v1/models tells it before the model loads
    model_config: object | None = None  # the checkpoint's models.config.ModelConfig: /api/tags describes it unloaded


@dataclass
class ServedModel:
    """A configured model and, while it is loaded, its engine."""

    spec: ModelSpec
    async_engine: "AsyncEngine | None" = None
    leases: int = 0  # requests between resolving to this model and their response's end
    in_flight: int = 0  # engine requests admitted and not finished (the model's own queue limit)
    last_used: float = 0.0  # monotonic; the LRU order
    loading: bool = False
    unloading: bool = False  # detached from requests, its engine stopping and its memory not yet given back
    keep_alive: float | None = None  # seconds idle before it is unloaded; None: kept loaded
    policy: KeepAlive = KeepAlive()  # the operator's bounds on a request's own keep_alive
    idle_since: float | None = None  # monotonic; when its last lease ended (None: leased, or not seen idle yet)
    on_idle: Callable[[], None] | None = field(default=None, repr=False)  # the pool's wake-up: a lease ended

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def loaded(self) -> bool:
        return self.async_engine is not None

    def release(self) -> None:
        """End one lease (a request's response has ended); the last one starts the keep-alive clock."""
        self.leases -= 1
        if self.leases == 0:
            self.idle_since = time.monotonic()
            if self.on_idle is not None:
                self.on_idle()

    def keep_for(self, seconds: float | None, *, may_shorten: bool) -> float | None:
        """Unload this model once idle `seconds` (None: never), within the operator's bounds (KeepAlive.bound);
        the request holding it sets it (Ollama's keep_alive), and it holds until a later request sets another.
        Returns the value that holds."""
        self.keep_alive = self.policy.bound(seconds, may_shorten)
        return self.keep_alive


class ModelLoadError(Exception):
    """A model could not be made ready: it failed to load, or its load outlasted the wait (`timed_out`)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


# Blocking, on a worker thread: build, warm up and start the model's engine; and stop it, releasing its memory.
Loader = Callable[[ServedModel], "AsyncEngine"]
Unloader = Callable[[ServedModel, "AsyncEngine"], None]


class ModelPool:
    """The configured models; the first one is the default (requests that name none, TGI routes)."""

    def __init__(self, specs: list[ModelSpec], max_loaded: int | None = None, load_timeout: float = 60.0,
                 keep_alive: KeepAlive = KeepAlive()) -> None:
        if not specs:
            raise ValueError("a model pool needs at least one model")
        self.keep_alive = keep_alive.default  # --keep-alive: what a request that names none gets (None: kept loaded)
        self.models = {s.name: ServedModel(s, keep_alive=keep_alive.default, policy=keep_alive,
                                           on_idle=self._wake_expiry) for s in specs}
        self.default = self.models[specs[0].name]
        self.max_loaded = max_loaded or len(specs)
        self.load_timeout = load_timeout
        self.loader: Loader | None = None
        self.unloader: Unloader | None = None
        self._loads: dict[str, asyncio.Future] = {}
        self._one_load: asyncio.Lock | None = None  # made on the event loop, at the first load
        self._expiry_wake: asyncio.Event | None = None  # made by expire_idle, on the event loop

    def get(self, name: str) -> ServedModel | None:
        return self.models.get(name)

    def loaded(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.loaded]

    def lease(self, model: ServedModel) -> ServedModel:
        """Hold `model` for one request (release() when its response ends): it is not unloaded meanwhile."""
        model.leases += 1
        model.last_used = time.monotonic()
        model.idle_since = None
        model.keep_alive = self.keep_alive  # the request's own keep_alive (Ollama's) replaces it after this
        return model

    async def ready(self, model: ServedModel) -> None:
        """Return once `model` is loaded (loading it, or waiting for its load); ModelLoadError if it cannot be."""
        if model.loaded:
            return
        if model.spec.config is None or self.loader is None:
            raise ModelLoadError(f"model {model.name!r} is not loaded")
        load = self._loads.get(model.name)
        if load is None:
            load = self._loads[model.name] = asyncio.ensure_future(self._load(model))
            load.add_done_callback(lambda _: self._loads.pop(model.name, None))
        try:  # shield: a waiter that gives up (timeout, client gone) does not cancel the load others wait for
            await asyncio.wait_for(asyncio.shield(load), self.load_timeout)
        except asyncio.TimeoutError:
            raise ModelLoadError(f"model {model.name!r} is still loading after {self.load_timeout:g} s; retry "
                                 "shortly", timed_out=True) from None

    def _lock(self) -> asyncio.Lock:
        if self._one_load is None:
            self._one_load = asyncio.Lock()
        return self._one_load

    async def _load(self, model: ServedModel) -> None:
        async with self._lock():
            if model.loaded:
                return
            await self._make_room()
            model.loading = True
            try:
                model.async_engine = await asyncio.to_thread(self.loader, model)
            except Exception as e:  # noqa: BLE001 - every waiter gets the reason; the next request tries again
                log.exception("loading model %s failed", model.name)
                # the reason stays in the log: it names files, and the caller may be any key
                raise ModelLoadError(f"model {model.name!r} failed to load ({type(e).__name__}; the server log "
                                     "says why)") from None
            finally:
                model.loading = False

    async def _make_room(self) -> None:
        """Unload least-recently-used idle models until one more fits under max_loaded (waits while all are busy)."""
        while len(self.loaded()) >= self.max_loaded:
            victim = self.lru_idle()
            if victim is None:
                await asyncio.sleep(0.02)
                continue
            log.info("unloading model %s (least recently used; %d loaded, limit %d)", victim.name,
                     len(self.loaded()), self.max_loaded)
            await self._unload(victim)

    async def _unload(self, victim: ServedModel) -> None:
        """Unload an idle model (the caller holds the load lock and checked it has no lease)."""
        engine, victim.async_engine = victim.async_engine, None  # no new request can take it from here on
        victim.idle_since, victim.unloading = None, True
        try:
            await asyncio.to_thread(self.unloader, victim, engine)
            gone = weakref.ref(engine)
            del engine  # the pool's reference: its weights and KV pool are freed by the collection below
            # A response that has just ended (its lease released, which may have started this unload) can still hold
            # its ModelState, and so the engine, for a moment: collect again until the engine is gone, or the trim
            # runs before its memory is free and the RSS stays up until the next unload (seen on a fast host).
            for _ in range(RELEASE_TRIES):
                await asyncio.to_thread(release_memory)
                if gone() is None:
                    break
                await asyncio.sleep(RELEASE_RETRY_S)
            else:
                log.warning("model %s: its engine is still referenced after unloading; its memory stays in use",
                            victim.name)
        finally:
            victim.unloading = False

    def _expiry(self, model: ServedModel) -> float | None:
        """When (monotonic) a loaded model's keep-alive runs out; None: it is leased, kept, or cannot be reloaded."""
        if model.leases or model.keep_alive is None or model.idle_since is None or model.spec.config is None:
            return None
        return model.idle_since + model.keep_alive

    def expired(self, now: float) -> list[ServedModel]:
        """Loaded models idle past their keep-alive."""
        return [m for m in self.loaded() if (at := self._expiry(m)) is not None and at <= now]

    def _next_expiry(self, now: float) -> float | None:
        """Seconds until the next model's keep-alive runs out (None: none will without a request)."""
        times = [at for m in self.loaded() if (at := self._expiry(m)) is not None]
        return max(0.0, min(times) - now) if times else None

    async def _expire(self, model: ServedModel) -> None:
        async with self._lock():
            if not any(m is model for m in self.expired(time.monotonic())):  # a request took it meanwhile
                return
            log.info("unloading model %s (idle past its keep-alive of %g s)", model.name, model.keep_alive)
            try:
                await self._unload(model)
            except Exception:  # noqa: BLE001 - the task serves the server's life; the next expiry tries others
                log.exception("unloading model %s failed", model.name)

    def _wake_expiry(self) -> None:
        if self._expiry_wake is not None:
            self._expiry_wake.set()

    async def expire_idle(self) -> None:
        """Run for the server's life (a task on its event loop): unload each model idle past its keep-alive.

        It sleeps until the next expiry or until a lease ends; a model loaded at start that no request has
        used counts as idle from the first time this task sees it (with --keep-alive it looks every few seconds,
        so a start-up load that ends while it sleeps is seen).
        """
        self._expiry_wake = asyncio.Event()
        while True:
            now = time.monotonic()
            for model in self.loaded():
                if model.leases == 0 and model.idle_since is None:
                    model.idle_since = now
            for model in self.expired(now):
                await self._expire(model)
            self._expiry_wake.clear()
            wait = self._next_expiry(time.monotonic())
            if self.keep_alive is not None:
                wait = min(wait if wait is not None else _LOOK_S, _LOOK_S)
            try:
                await asyncio.wait_for(self._expiry_wake.wait(), wait)
            except asyncio.TimeoutError:
                pass

    def lru_idle(self) -> ServedModel | None:
        """The loaded model used least recently that no request holds and that can be loaded again."""
        idle = [m for m in self.loaded() if m.leases == 0 and m.spec.config is not None]
        return min(idle, key=lambda m: m.last_used, default=None)

    def engines(self) -> list["AsyncEngine"]:
        """The engines of the loaded models."""
        return [m.async_engine for m in self.models.values() if m.async_engine is not None]


def release_memory() -> None:
    """Collect the unloaded engine's reference cycles and give its memory back: CUDA's cached blocks to the device,
    the C heap's free pages to the system.

    `serve` freezes what the start made (gc.freeze: shorter collections), the first model's engine included; a
    frozen cycle is never collected, so the frozen objects are thawed for this one collection and the
    survivors frozen again. glibc keeps freed heap memory for reuse (RSS would not drop): malloc_trim returns it.
    """
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
    _malloc_trim()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def one_malloc_arena() -> None:
    """Make every thread allocate from glibc's main arena (mallopt M_ARENA_MAX = 1); call it before threads start.

    Why: an unload's memory is freed on the thread that held it (the loader, the engine thread), and glibc gives
    such threads arenas of their own. malloc_trim(0) returns the free pages inside every arena, but trims only the
    main arena's top: freed memory at the top of a thread's arena stays resident. Each load/unload cycle left
    10-40 MB more (the embedded model, 5 cycles: 269 -> 325 MiB); with one arena the process comes back to
    within 1 MiB every time. The server's threads rarely malloc at once (Python code holds the GIL; a step's
    tensors are allocated on the engine thread), so one arena should cost little lock contention (not yet measured
    on a quiet machine: benchmarks/compare.py's c=16/32 rows would show it). A no-op off glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, 1)
    except (OSError, AttributeError):  # not glibc
        pass


def _malloc_trim() -> None:
    """glibc's malloc_trim(0): free heap pages back to the system (a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
