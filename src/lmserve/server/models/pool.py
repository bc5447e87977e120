"""The server's models by name (`--model NAME=PATH`, repeatable): loaded on demand, the least recently used one
unloaded when a load would pass `--max-loaded-models`.

Invariants:
- Loads run one at a time (two checkpoints never load at once: memory is bounded by K loaded models plus none).
- A request that finds its model loading waits for that same load (one load, however many wait), bounded by
  the pool's load timeout: the caller answers 503 + Retry-After then, and the load goes on for the next request.
- A model is unloaded only when no request holds a lease on it (`leases`: from the request's model resolution
  to its response's end), so a request never sees its engine go away; a load that needs room waits for one.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from lmserve.config import EngineConfig

if TYPE_CHECKING:
    from lmserve.engine.serving import AsyncEngine

log = logging.getLogger("lmserve.server")


@dataclass(frozen=True)
class ModelSpec:
    """One configured model: its served name and how to build its engine."""

    name: str
    config: EngineConfig | None = None  # None: its engine is started by the caller and never unloaded
    max_model_len: int | None = None  # from the start-up checks: /v1/models tells it before the model loads


@dataclass
class ServedModel:
    """A configured model and, while it is loaded, its engine."""

    spec: ModelSpec
    async_engine: "AsyncEngine | None" = None
    leases: int = 0  # requests between resolving to this model and their response's end
    in_flight: int = 0  # engine requests admitted and not finished (the model's own queue limit)
    last_used: float = 0.0  # monotonic; the LRU order
    loading: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def loaded(self) -> bool:
        return self.async_engine is not None

    def release(self) -> None:
        """End one lease (a request's response has ended)."""
        self.leases -= 1


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

    def __init__(self, specs: list[ModelSpec], max_loaded: int | None = None, load_timeout: float = 60.0) -> None:
        if not specs:
            raise ValueError("a model pool needs at least one model")
        self.models = {s.name: ServedModel(s) for s in specs}
        self.default = self.models[specs[0].name]
        self.max_loaded = max_loaded or len(specs)
        self.load_timeout = load_timeout
        self.loader: Loader | None = None
        self.unloader: Unloader | None = None
        self._loads: dict[str, asyncio.Future] = {}
        self._one_load: asyncio.Lock | None = None  # made on the event loop, at the first load

    def get(self, name: str) -> ServedModel | None:
        return self.models.get(name)

    def loaded(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.loaded]

    def lease(self, model: ServedModel) -> ServedModel:
        """Hold `model` for one request (release() when its response ends): it is not unloaded meanwhile."""
        model.leases += 1
        model.last_used = time.monotonic()
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

    async def _load(self, model: ServedModel) -> None:
        if self._one_load is None:
            self._one_load = asyncio.Lock()
        async with self._one_load:
            if model.loaded:
                return
            await self._make_room()
            model.loading = True
            try:
                model.async_engine = await asyncio.to_thread(self.loader, model)
            except Exception as e:  # noqa: BLE001 - every waiter gets the reason; the next request tries again
                log.exception("loading model %s failed", model.name)
                raise ModelLoadError(f"model {model.name!r} failed to load ({type(e).__name__}: {e})"[:300]) from None
            finally:
                model.loading = False

    async def _make_room(self) -> None:
        """Unload least-recently-used idle models until one more fits under max_loaded (waits while all are busy)."""
        while len(self.loaded()) >= self.max_loaded:
            victim = self.lru_idle()
            if victim is None:
                await asyncio.sleep(0.02)
                continue
            engine, victim.async_engine = victim.async_engine, None  # no new request can take it from here on
            log.info("unloading model %s (least recently used; %d loaded, limit %d)", victim.name,
                     len(self.loaded()) + 1, self.max_loaded)
            await asyncio.to_thread(self.unloader, victim, engine)
            del engine  # the last reference: its weights and KV pool are freed now, not at some later collection
            await asyncio.to_thread(release_memory)

    def lru_idle(self) -> ServedModel | None:
        """The loaded model used least recently that no request holds and that can be loaded again."""
        idle = [m for m in self.loaded() if m.leases == 0 and m.spec.config is not None]
        return min(idle, key=lambda m: m.last_used, default=None)

    def engines(self) -> list["AsyncEngine"]:
        """The engines of the loaded models."""
        return [m.async_engine for m in self.models.values() if m.async_engine is not None]


def release_memory() -> None:
    """Collect the unloaded engine's reference cycles and hand CUDA's cached blocks back to the device."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
