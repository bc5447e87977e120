"""The app (Starlette): middlewares (body limit, auth, draining, status metrics), misc routes, error handlers."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import lmserve
from lmserve.ops.record import RequestRecord
from lmserve.server.access_log import AccessLog
from lmserve.server.api.chat_plan import plan_chat
from lmserve.server.api.dialects import DIALECTS, error_response, is_generation
from lmserve.server.batch import routes as batch_routes
from lmserve.server.errors import APIError
from lmserve.server.gate import health_body
from lmserve.server.key_file import ANONYMOUS
from lmserve.server.playground import routes as playground_routes
from lmserve.server.protocol import DetokenizeRequest, TokenizeRequest
from lmserve.server.router import Router
from lmserve.server.state import (
    CHARGED_KEY,
    KEY_NAME_KEY,
    LOADING_KEY,
    RECORD_KEY,
    ServerConfig,
    ServerState,
    key_name_of,
    read_request,
    release_leases,
    state_of,
)
from lmserve.utils import malloc_trim

# No API key needed: probes carry none (a dialect's too, as KServe's v2 health probes), and they tell only whether
# the process serves; /metrics too with --metrics-public (see open_paths).
OPEN_PATHS = ("/health", *(path for dialect in DIALECTS for path in dialect.open_paths))
# Requests that only read state: every other method on a keyed path takes one request from the key's rate.
FREE_METHODS = ("GET", "HEAD", "OPTIONS")

log = logging.getLogger("lmserve.server")


def build_app(state: ServerState, access_log: bool = True) -> Starlette:
    """The app over a ServerState (whose engine may still be loading); `access_log`: a log line per request."""
    routes = Router()
    for family in (*DIALECTS, batch_routes, playground_routes):
        routes.include(family.router)
    routes.include(_misc_routes())
    app = Starlette(routes=[*routes.routes, _openapi_route(routes)], exception_handlers=_error_handlers(),
                    lifespan=_lifespan(state))
    app.state.lm = state
    app.add_middleware(Observe, state=state)
    app.add_middleware(AuthAndStatus, state=state)
    if state.config.cors_allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.config.cors_allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(BodyLimit, max_bytes=state.config.max_body_bytes,
                       upload_bytes={"/v1/files": state.config.max_upload_bytes})
    app.add_middleware(AccessLog, enabled=access_log)  # outermost: its latency is the whole request's
    return app


def _openapi_route(routes: Router) -> Route:
    """/openapi.json: server/api/openapi.py's document of every route, built on its first request: that module
    (FastAPI's generator and ~60 answer models) is imported then, not on the path to the first token (issue 32)."""
    document: dict = {}

    async def openapi(request: Request) -> Response:
        if not document:
            from lmserve.server.api.openapi import build_document

            document.update(build_document(routes.endpoints))
        return JSONResponse(document)

    return Route("/openapi.json", openapi, methods=["GET"], include_in_schema=False)


def _lifespan(state: ServerState):
    """Start the batch-job runner on the server's event loop (it resumes jobs a previous run left), and the pool's
    keep-alive expiry (server/models/pool.py)."""

    @asynccontextmanager
    async def lifespan(app: Starlette):
        if state.batches is not None:
            state.batches.start()
        expiry = asyncio.ensure_future(state.models.expire_idle())
        yield
        expiry.cancel()
        if state.batches is not None:
            state.batches.stop()

    return lifespan


class AuthAndStatus:
    """Pure ASGI (no wrapping of `receive`, so handlers see real disconnects): API keys, rate-limit headers,
    status metrics. The key's name (never the key) goes into scope["state"] for the routes and the record."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state
        self.open_paths = open_paths(state.config)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st, path = self.state, scope.get("path", "")
        name = ANONYMOUS
        # Every method, OPTIONS included: a CORS preflight is answered by CORSMiddleware before this one.
        # The playground's page and files are open (no data in them; the page asks for the key).
        if st.tenants.enabled and path not in self.open_paths \
                and not playground_routes.is_public_page(scope.get("method", ""), path):
            headers = dict(scope.get("headers") or [])
            name = st.tenants.identify(headers.get(b"authorization", b"").decode("latin-1"),
                                       headers.get(b"x-api-key", b"").decode("latin-1"))
            if name is None:
                st.metrics.status(401)
                st.metrics.rejected.labels("unauthorized").inc()
                err = APIError(401, "missing or invalid API key", code="invalid_api_key")
                return await error_response(path, err)(scope, receive, send)
        scope.setdefault("state", {})[KEY_NAME_KEY] = name

        async def send_counted(message) -> None:
            if message["type"] == "http.response.start":
                st.metrics.status(message["status"], st.not_ready or LOADING_KEY in scope["state"])
                st.pacer.answered(name, message["status"], time.monotonic())
                # Read at response start: after admission took its share, before a stream's first byte.
                message = {**message, "headers": [*message.get("headers", []), *st.tenants.headers(name)]}
            await send(message)

        if scope.get("method") not in FREE_METHODS and path not in self.open_paths:
            try:  # before any work: a body is parsed, rendered or tokenized only inside the key's rate
                st.tenants.take_request(name)
            except APIError as err:
                st.metrics.rejected.labels(err.reason).inc()
                return await error_response(path, err)(scope, receive, send_counted)
            scope["state"][CHARGED_KEY] = True
            wait = st.pacer.arrive(name, time.monotonic())
            if wait > 0:  # its requests keep being refused while other keys are served (server/pacing.py)
                st.metrics.key_paced.labels(name).inc()
                await asyncio.sleep(wait)
        try:
            await self.app(scope, receive, send_counted)
        finally:  # the response has ended (a stream's last chunk sent): its model may be unloaded again
            release_leases(scope)


def open_paths(config: ServerConfig) -> tuple[str, ...]:
    """Paths served without an API key: /health always (probes carry no key), /metrics only when asked."""
    return OPEN_PATHS + (("/metrics",) if config.metrics_public else ())


class Observe:
    """Pure ASGI: one RequestRecord per generation request, handed to Ops when the response has ended.

    The end is the last body message sent (after [DONE] for a stream), or the app returning without
    one: then the client left first and the record says 499. Error bodies are read back for the message.
    """

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not is_generation(scope.get("path", "")):
            return await self.app(scope, receive, send)
        ops = self.state.ops
        record = RequestRecord(f"http-{id(scope):x}", scope["path"])
        record.key_name = scope.setdefault("state", {}).get(KEY_NAME_KEY, ANONYMOUS)
        record.rate_charged = scope["state"].get(CHARGED_KEY, False)
        scope["state"][RECORD_KEY] = record
        ops.begin(record, {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or []})
        error_body: list[bytes] = []

        async def send_observed(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body":
                if record.status >= 400 and sum(map(len, error_body)) < 4096:
                    error_body.append(message.get("body", b""))
                if not message.get("more_body", False):
                    _close(record, error_body)
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        finally:
            if record.e2e_s is None:  # no last body message went out: the client hung up
                record.status, record.error = 499, "client disconnected"
                _close(record, [])
            self.state.tenants.settle(record)  # frees the key's slot, returns its unused tokens
            ops.finish(record)


def _close(record: RequestRecord, error_body: list[bytes]) -> None:
    record.e2e_s = time.monotonic() - record.start
    if record.status >= 400 and error_body:
        record.error = _error_message(b"".join(error_body))


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-, Anthropic- or TGI-shaped error body."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")
    return str(err.get("message") if isinstance(err, dict) else err)[:400]


class BodyLimit:
    """Pure ASGI: refuse bodies over `max_bytes` (per path in `upload_bytes`) with 413 before reading them whole."""

    def __init__(self, app, max_bytes: int, upload_bytes: dict[str, int] | None = None) -> None:
        self.app, self.default_bytes, self.upload_bytes = app, max_bytes, upload_bytes or {}
        self.trim = HeapTrim()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.upload_bytes.get(scope.get("path", ""), self.default_bytes)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await self._too_large(scope, send, limit)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._too_large(scope, send, limit)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False
        large = size >= TRIM_AFTER_BYTES
        if large:
            self.trim.begin()

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            chunks.clear()
            body = b""  # the replay's copy too (a closure cell): the heap below is free only once nothing holds it
            if large:
                self.trim.end()

    async def _too_large(self, scope, send, limit: int) -> None:
        err = APIError(413, f"request body exceeds the limit of {limit} bytes")
        await error_response(scope.get("path", ""), err)(scope, _empty_receive, send)


TRIM_AFTER_BYTES = 2**20  # a body this large leaves megabytes free in the heap (its JSON, text, tokens)


class HeapTrim:
    """Give the free heap back (malloc_trim, off the event loop) once no large request is in flight and none has
    ended for `quiet_s`.

    Not after each: a trim hands back the engine's freed step buffers too, which keep_freed_memory keeps for
    reuse (each step would page-fault them in again), and a flood of 1.3 MB bodies trimmed one by one slowed
    another client's time to first token 5x. Nor while one runs: requests that each outlast `quiet_s` (test_abuse's
    logit_bias bomb took up to 1.2 s, back to back) would have a plain timer trim inside their flood. Measured:
    three /tokenize calls of 4 MiB left RSS at 0.89 GB (from 0.41) without a trim, 0.40 GB with one.
    """

    def __init__(self, quiet_s: float = 1.0) -> None:
        self.quiet_s = quiet_s
        self._in_flight = 0
        self._timer: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        """A large request's body has arrived: no trim until it ends."""
        self._in_flight += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def end(self) -> None:
        """A large request has ended: trim once none is in flight and none has ended for `quiet_s`."""
        self._in_flight -= 1
        if self._in_flight == 0:
            self._timer = asyncio.get_running_loop().call_later(self.quiet_s, self._trim)

    def _trim(self) -> None:
        self._timer = None
        asyncio.get_running_loop().run_in_executor(None, malloc_trim)


async def _empty_receive():
    return {"type": "http.request", "body": b"", "more_body": False}


def _misc_routes() -> Router:
    router = Router()

    @router.get("/health")
    async def health(request: Request) -> Response:
        st = state_of(request)
        if st.ready:
            return JSONResponse({"status": "ok"})
        if st.draining or (st.started and st.dead):
            return JSONResponse({"status": "draining" if st.draining else "dead"}, status_code=503)
        return JSONResponse(health_body(loading=st.load_error is None), status_code=503)  # as the StartGate says

    @router.get("/version")
    async def version() -> dict:
        return {"version": lmserve.__version__}

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Every key's label and usage are in it: with keys, admin keys only (a server with plain keys alone has
        none: 403 for all) unless --metrics-public; on a server without keys, open like every route."""
        st = state_of(request)
        if not st.config.metrics_public and not st.tenants.is_admin(key_name_of(request)):
            raise APIError(403, "/metrics is for admin keys (role: admin in --api-key-file), or start the server "
                           "with --metrics-public", code="permission_denied")
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4")

    @router.get("/v1/monitoring/drift")
    async def drift(request: Request) -> dict:
        st = state_of(request)
        if st.ops.drift is None:
            raise APIError(404, "drift monitoring is off; start the server with --drift-reference FILE or "
                           "--drift-capture N")
        return st.ops.drift.report()

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        """Ids as generation would see them: `prompt` as a completions prompt, `messages` as a chat; llama.cpp's
        `content` (special tokens only with its `add_special`) answers in llama.cpp's shape, {"tokens": [...]}."""
        st, req = await read_request(request, TokenizeRequest)
        tok = st.front.tokenizer
        if sum(x is not None for x in (req.prompt, req.messages, req.content)) != 1:
            raise APIError(400, "give exactly one of 'prompt', 'messages' or 'content'")
        try:
            if req.content is not None:
                return {"tokens": await asyncio.to_thread(tok.encode_prompt, req.content, req.add_special)}
            if req.messages is not None:
                tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
                chat = plan_chat(st, [m.model_dump(exclude_none=True) for m in req.messages], tools).chat
                ids = await asyncio.to_thread(tok.encode_chat, chat.messages, True, **chat.template_kwargs)
            else:
                ids = await asyncio.to_thread(tok.encode_prompt, req.prompt, req.add_special_tokens)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": st.front.max_model_len}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        st, req = await read_request(request, DetokenizeRequest)
        vocab = st.front.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of vocabulary (valid ids are 0..{vocab - 1})", param="tokens")
        text = await asyncio.to_thread(st.front.tokenizer.decode, req.tokens)
        return {"prompt": text, "content": text}  # content: llama.cpp's name (its requests look the same as ours)

    return router


def _error_handlers() -> dict:
    async def api_error(request: Request, exc: APIError) -> Response:
        if exc.reason is not None:
            state_of(request).metrics.rejected.labels(exc.reason).inc()
        if exc.reason == "model_loading":  # expected while a model loads, as at start: not a 5xx
            request.scope["state"][LOADING_KEY] = True
        return error_response(request.url.path, exc)

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        messages = {404: f"no route {request.method} {request.url.path[:100]}",
                    405: f"method {request.method} is not allowed on {request.url.path[:100]}"}
        message = messages.get(exc.status_code, str(exc.detail)[:200])
        return error_response(request.url.path, APIError(exc.status_code, message, headers=dict(exc.headers or {})))

    async def unexpected(request: Request, exc: Exception) -> Response:
        # Never a traceback or a path in the body; the log has the details.
        log.exception("unhandled error on %s", request.url.path[:100])
        return error_response(request.url.path, APIError(500, f"internal error ({type(exc).__name__})"))

    return {APIError: api_error, StarletteHTTPException: http_error, Exception: unexpected}
