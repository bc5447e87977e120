"""The ASGI app uvicorn serves from the first moment of `lmserve serve`: it answers for the real app while torch, the
engine and the routes are imported and the flags and models checked (server/start.py), then hands every request on.

Why: the port listens ~0.3 s after the process starts, while `import torch` alone takes 1-2 s; a client that starts
the server and sends at once should be answered, not refused. Torch-free on purpose: it imports Starlette's response
and the error bodies only (server/api/dialects.py, torch-free too).

Until `open(app)`: the readiness probes answer at once and truthfully (/health: 503 `loading`, with llama.cpp's error
object beside vLLM/TGI's status; KServe's /v2/health/ready: 503; /v2/health/live: 200, the process is live), and
every other request waits for the app (at most `timeout` seconds from its arrival, then 503 in its API family's
error body) and is then served by it, where a generation request waits on for the model (ServerState.wait_ready,
with the same deadline: ARRIVED_KEY). After `fail()`: a failed start, 503 for everything while the process exits.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager
from typing import Callable

from starlette.responses import JSONResponse

from lmserve.server.api.dialects import error_response
from lmserve.server.connections import ARRIVED_KEY
from lmserve.server.errors import APIError

# /health while the model loads: vLLM and TGI answer a bare 503, llama.cpp this error object; both are here.
LOADING = {"status": "loading", "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
FAILED = {"status": "failed", "error": {"code": 503, "message": "The model failed to load; the server is stopping "
                                        "(its log says why)", "type": "unavailable_error"}}


def health_body(loading: bool) -> dict:
    """/health's 503 body while loading, or after a failed start (the app's /health answers the same)."""
    return LOADING if loading else FAILED


class StartGate:
    """Pure ASGI: answers for the app until it is opened (see the module doc), then passes everything to it."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout  # --model-load-timeout: how long a request waits for the start
        self.app = None
        self.failed = False
        self.loop: asyncio.AbstractEventLoop | None = None  # uvicorn's, known from its lifespan startup
        self._opened: asyncio.Event | None = None
        self._app_lifespan: AbstractAsyncContextManager | None = None
        self.answered: list[int] = []  # the statuses the gate answered itself: counted in the metrics at open()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if self.app is None and scope["type"] == "http":
            scope.setdefault("state", {})[ARRIVED_KEY] = time.monotonic()
            early = self._probe(scope.get("path", ""))
            if early is not None:
                self.answered.append(early.status_code)
                return await early(scope, receive, send)
            await self._wait()
        if self.app is None:
            return await self._refuse(scope, receive, send)
        await self.app(scope, receive, send)

    def _probe(self, path: str) -> JSONResponse | None:
        """The answer of a readiness probe before the app exists (None: not a probe)."""
        if path == "/health":
            return JSONResponse(health_body(not self.failed), status_code=503)
        if path == "/v2/health/ready":
            return JSONResponse({"error": "the server is not ready (loading)"}, status_code=503)
        if path == "/v2/health/live" and not self.failed:
            return JSONResponse({"live": True})
        return None

    async def _wait(self) -> None:
        if self._opened is None or self.failed:
            return
        try:
            await asyncio.wait_for(self._opened.wait(), self.timeout)
        except asyncio.TimeoutError:
            pass

    async def _refuse(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        if self.failed:
            err = APIError(503, "the model failed to load; the server is stopping", headers={"Retry-After": "30"})
        else:
            err = APIError(503, f"the model is still loading after {self.timeout:g} s; retry shortly",
                           headers={"Retry-After": "5"}, reason="model_loading")
            self.answered.append(err.status)
        await error_response(path, err)(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        """uvicorn's lifespan: started at once (the app's own lifespan runs when it opens), and ended with the app's."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.loop, self._opened = asyncio.get_running_loop(), asyncio.Event()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._app_lifespan is not None:
                    await self._app_lifespan.__aexit__(None, None, None)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def open(self, app, count: Callable[[int], None] = lambda status: None) -> None:
        """Serve `app` (a Starlette app) from now on, its lifespan started first; run on the gate's loop. `count`
        gets the status of each answer the gate gave itself (the app's metrics did not exist yet); on the loop,
        so none is answered between the count and the hand-over."""
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        for status in self.answered:
            count(status)
        self._app_lifespan, self.app, self.answered = lifespan, app, []
        self._opened.set()

    def fail(self) -> None:
        """The start failed: refuse everything (waiting requests at once) while the process exits."""
        self.failed = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._opened.set)
