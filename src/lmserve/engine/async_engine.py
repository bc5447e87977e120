"""AsyncEngine: runs LLMEngine on its own thread and streams deltas to asyncio callers.

The HTTP server touches only this. The engine thread drains an inbox of adds and aborts between
steps, so a request joins at the next step boundary and an abort frees its blocks within one step;
torch releases the GIL while it computes, so the event loop stays responsive.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Union

from lmserve.engine.front import EngineFront
from lmserve.engine.llm_engine import LLMEngine
from lmserve.engine.stats import StepStats
from lmserve.errors import EngineDeadError, StepFailedError
from lmserve.request import CompletionDelta, EngineRequest

log = logging.getLogger(__name__)


# One failed step may be one bad batch; this many in a row (each failing batch already removed) means the
# engine itself is broken, and a restart is the only repair.
MAX_FAILED_STEPS_IN_A_ROW = 3


class EngineHungError(RuntimeError):
    """An engine step made no progress for the watchdog's timeout."""


@dataclass(frozen=True)
class EngineFault:
    """Engine thread -> fault listeners (metrics, the server's exit): a failed step, or the engine's death."""

    fatal: bool
    error: str  # the exception's type name
    request_ids: tuple[str, ...] = ()  # client request ids failed by the step (a fatal fault fails them all)


@dataclass(frozen=True)
class AbortRequest:
    """Asyncio side -> engine thread: abort this request and free its blocks."""

    request_id: str


@dataclass(frozen=True)
class Wake:
    """Asyncio side -> engine thread: stop waiting on the inbox (shutdown sends it)."""


# Asyncio side -> engine thread; an EngineRequest itself (frozen, made once at admission) is queued at the next
# step boundary, not wrapped.
EngineMessage = Union[EngineRequest, AbortRequest, Wake]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    pending: int  # completions not finished yet


class AsyncEngine:
    """Thread-backed async front of one LLMEngine."""

    def __init__(self, engine: LLMEngine, step_timeout: float | None = None) -> None:
        self.engine = engine
        # A step making no progress for this long means a hung engine (a deadlock, a stuck kernel): the watchdog
        # declares it dead. None: no watchdog. A Python thread cannot be stopped, so dead is all we can do.
        self.step_timeout = step_timeout
        self._step_started: float | None = None  # monotonic start of the step in progress, None between steps
        self._inbox: queue.SimpleQueue[EngineMessage] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dead: BaseException | None = None
        self.step_listeners: list[Callable[[StepStats, list[CompletionDelta]], None]] = []
        self.fault_listeners: list[Callable[[EngineFault], None]] = []  # called on the engine thread
        self._failed_in_a_row = 0
        self.num_requests_in_flight = 0
        self._handlers: dict[type, Callable] = {EngineRequest: self._add, AbortRequest: self._abort, Wake: _ignore}
        # a tensor-parallel rank that dies while the engine is idle is fatal too (worker/executor.py's watcher)
        engine.executor.on_fatal = self._die

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lmserve-engine", daemon=True)
            self._thread.start()
            if self.step_timeout is not None:
                threading.Thread(target=self._watch, name="lmserve-watchdog", daemon=True).start()

    def shutdown(self) -> None:
        """Stop the engine thread after its current step."""
        self._stop.set()
        self._inbox.put(Wake())
        if self._thread is not None:
            self._thread.join(timeout=30 if self.dead is None else 1)  # a hung thread never joins
        self.engine.close()  # tensor-parallel worker ranks end with the engine

    @property
    def front(self) -> EngineFront:
        """What callers use before a request enters the engine: tokenizer, checks, grammars, adapters, load."""
        return self.engine.front

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    async def generate(self, request: EngineRequest) -> AsyncIterator[CompletionDelta]:
        """Stream the deltas of every completion of a request; closing the iterator aborts it.

        Its `max_tokens` is what `front.check_request` returned (the server checks it before admitting); None has
        the engine thread check it, and a rejection then ends the stream. Its `grammar` and `lora` were compiled
        and read by the caller, off the engine thread.
        """
        request_id = request.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), request.params.n)
        with self._lock:  # dead is set under the lock: a stream registered here is failed if the engine dies
            if self.dead is not None:
                raise EngineDeadError("the engine has stopped")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self.num_requests_in_flight += 1
        self._inbox.put(request)
        try:
            while stream.pending > 0:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    stream.pending -= 1
                yield item
        finally:
            self.num_requests_in_flight -= 1
            if stream.pending > 0:  # the caller went away (disconnect, cancel): free its blocks
                self.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort a request at the next step boundary."""
        self._inbox.put(AbortRequest(request_id))

    def abort_all(self) -> None:
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self.abort(rid)

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # noqa: BLE001 - any failure here must reach every waiting caller
            self._die(e)

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            deltas = self.engine.step()
        except Exception as e:  # noqa: BLE001 - one failed step fails its requests; a BaseException ends the thread
            self._step_failed(e)
            return
        finally:
            self._step_started = None
        self._failed_in_a_row = 0
        self._publish(deltas)
        for listener in self.step_listeners:
            listener(self.engine.last_step, deltas)

    def _step_failed(self, error: Exception) -> None:
        """Fail the requests of the failed step (their blocks freed) and serve on; too many in a row is fatal."""
        log.error("engine step failed; failing the requests of that step", exc_info=error)
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            raise EngineDeadError(f"{self._failed_in_a_row} engine steps in a row failed") from error
        failed = self.engine.fail_step()  # if recovery itself raises, the engine is inconsistent: the thread dies
        for rid in failed:
            self._send(rid, StepFailedError(f"the engine step running this request failed ({type(error).__name__})"))
        self._notify(EngineFault(False, type(error).__name__, tuple(failed)))

    def _watch(self) -> None:
        """Watchdog thread: a step that makes no progress for step_timeout is a hung engine; declare it dead.

        Checked 10x a timeout. Progress is a new step or a decoder layer run (engine.progress()): a long step on a
        slow host bumps it every layer, a deadlock or a stuck kernel never does.
        """
        seen, since = None, time.monotonic()
        while not self._stop.wait(self.step_timeout / 10) and self.dead is None:
            started, now = self._step_started, time.monotonic()
            mark = (started, self.engine.progress())
            if mark != seen:
                seen, since = mark, now
            elif started is not None and now - since > self.step_timeout:
                log.critical("engine step without progress for over %g s (running for %.0f s); the engine thread is "
                             "at:\n%s", self.step_timeout, now - started, _stack_of(self._thread))
                self._die(EngineHungError(f"an engine step has made no progress for over {self.step_timeout:g} s"))
                return

    def _die(self, error: BaseException) -> None:
        """The engine is unusable: fail every stream, refuse new ones, tell the listeners (the server exits)."""
        log.critical("engine thread died", exc_info=error)
        with self._lock:
            if self.dead is not None:  # the watchdog and a late-dying thread: only the first one reports
                return
            self.dead = error
            ids = tuple(self._streams)
        self._fail_all(EngineDeadError(f"the engine failed: {type(error).__name__}"))
        self._notify(EngineFault(True, type(error).__name__, ids))

    def _notify(self, fault: EngineFault) -> None:
        for listener in self.fault_listeners:
            try:
                listener(fault)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the others (the exit is one)
                log.exception("engine fault listener failed")

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: EngineMessage) -> None:
        self._handlers[type(msg)](msg)

    def _add(self, request: EngineRequest) -> None:
        try:
            self.engine.add(request)
        except ValueError as e:  # a request id in use, or an unchecked request refused: only its caller hears
            self._send(request.request_id, e)

    def _abort(self, msg: AbortRequest) -> None:
        self._publish(self.engine.abort(msg.request_id))

    def _publish(self, deltas: list[CompletionDelta]) -> None:
        """Hand a step's deltas to their streams: one lock and one call_soon_threadsafe per event loop, not per delta.

        Each call_soon_threadsafe takes the loop's lock and writes its self-pipe; at 16-32 streams a call per delta
        cost the engine thread that many syscalls a step and woke the loop as often (its callbacks then ran one by
        one, each needing the GIL the engine thread wants back)."""
        if not deltas:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        with self._lock:
            for d in deltas:
                stream = self._streams.get(d.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, d))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _send(self, request_id: str, item: object) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.items())
        for rid, _ in streams:
            self._send(rid, error)


def _stack_of(thread: threading.Thread | None) -> str:
    """Where `thread` is now (for the hung-engine log line)."""
    frame = sys._current_frames().get(thread.ident) if thread is not None else None
    return "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: a step's deltas into their streams' queues, in the engine's order."""
    for q, item in items:
        q.put_nowait(item)


def _ignore(msg: Wake) -> None:
    """A Wake only has to end the inbox wait; the loop then sees the stop flag."""
