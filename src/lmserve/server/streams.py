"""Driving engine streams from HTTP handlers: merge several, abort them when the client leaves, and serve them.

A disconnect is noticed by listening on the ASGI receive channel (not only when a write fails),
so a client that hangs up during a long prefill frees its KV blocks within one engine step.

`encoded_stream` is the one stream body of every API family: it owns the disconnect watch, the error met part-way
and the stop; a family supplies only its `StreamEncoder` (how an event, an error and the end are written).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request

from lmserve.errors import EngineDeadError, StepFailedError
from lmserve.request import CompletionDelta
from lmserve.server.errors import APIError

_DONE = object()
log = logging.getLogger(__name__)


class MergedStreams:
    """Interleaves the deltas of several engine streams as (stream index, delta); cancel() aborts all."""

    def __init__(self, streams: list[AsyncIterator[CompletionDelta]]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]
        self._open = len(streams)
        self.cancelled = False

    async def _pump(self, i: int, stream: AsyncIterator[CompletionDelta]) -> None:
        try:
            async for delta in stream:
                self._queue.put_nowait((i, delta))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which answers with an error
            self._queue.put_nowait((i, e))
        finally:
            await stream.aclose()  # aborts the request in the engine if it has not finished
            self._queue.put_nowait((i, _DONE))

    def cancel(self) -> None:
        """Abort every stream (the client went away); `cancelled` tells the handler not to answer."""
        self.cancelled = True
        self.stop()

    def stop(self) -> None:
        """Stop the pumps (a stream that has not finished is aborted by its own cleanup)."""
        for t in self._tasks:
            t.cancel()

    async def __aiter__(self):
        try:
            while self._open:
                i, item = await self._queue.get()
                if item is _DONE:
                    self._open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            self.stop()  # normal end or consumer error: stop any stream still running


def engine_error(e: Exception) -> APIError | None:
    """The HTTP error for an engine failure under a request (None: not one; a bug, for the 500 handler)."""
    if isinstance(e, StepFailedError):  # this request's step failed; the engine serves on
        return APIError(500, str(e), code="engine_step_failed")
    if isinstance(e, EngineDeadError):  # the process is exiting so its supervisor restarts it
        return APIError(503, "the engine has stopped; the server is restarting", headers={"Retry-After": "30"},
                        code="engine_dead")
    return None


def stream_failure(e: Exception, metrics, path: str) -> APIError:
    """The error a stream that failed part-way reports in-band (each API family in its own body), counted as an
    error abort; anything but an engine failure is a bug, logged with its traceback (call it from `except`)."""
    metrics.aborts.labels("error").inc()
    err = engine_error(e)
    if err is None:
        log.exception("stream failed on %s", path)
        err = APIError(500, f"internal error ({type(e).__name__})")
    return err


async def watch_disconnect(request: Request, merged: MergedStreams, on_disconnect) -> None:
    """Wait for the client to go away; then abort its streams (run as a task, cancelled when done)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            log.debug("client disconnected: aborting %d stream(s)", len(merged._tasks))
            if not merged.cancelled:
                on_disconnect()
                merged.cancel()
            return


class Watched:
    """Context: a disconnect watcher running for as long as a response is being produced (no request: none)."""

    def __init__(self, request: Request | None, merged: MergedStreams, on_disconnect) -> None:
        self.task = None if request is None else asyncio.create_task(watch_disconnect(request, merged, on_disconnect))

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()


@dataclass(frozen=True)
class StreamEncoder:
    """How one API family writes its stream: an event, an error met part-way, and what ends the stream."""

    event: Callable[[Any], str]
    # The status line (200) is gone by the time a stream fails, so each family says so in-band, in its own body:
    # its official client raises on it.
    error: Callable[[APIError], str]
    end: str = ""  # written after the last event and after an error alike (OpenAI's `data: [DONE]`)


def encoded_stream(request: Request, metrics, merged: MergedStreams, items: AsyncIterator[Any],
                   encoder: StreamEncoder) -> AsyncIterator[str]:
    """The body of a streamed answer: `items` through `encoder`; a disconnect aborts `merged`, a failure part-way is
    the encoder's error, and however it ends, every stream still running is stopped (its KV blocks freed)."""
    # Started before the response is sent: nothing between admission and the body's first event goes unwatched.
    watch = Watched(request, merged, lambda: metrics.aborts.labels("client_disconnect").inc())
    return _encode(request.url.path, metrics, merged, watch, items, encoder)


async def _encode(path: str, metrics, merged: MergedStreams, watch: Watched, items: AsyncIterator[Any],
                  encoder: StreamEncoder) -> AsyncIterator[str]:
    try:
        async for item in items:
            yield encoder.event(item)
    except Exception as e:  # noqa: BLE001 - reported in-band; stream_failure logs a bug's traceback
        yield encoder.error(stream_failure(e, metrics, path))
    finally:  # also on GeneratorExit / cancellation (the server closing the body of a client that left)
        watch.close()
        merged.stop()
    if encoder.end:
        yield encoder.end
