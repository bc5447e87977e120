"""An HTTP request as plain data, its routing key, and a bridge that runs it through lmserve's ASGI app.

The Ray Serve ingress reads a request once, turns it into a `ForwardedRequest` (picklable: it crosses a
Ray call) and hands it to an engine replica, which runs it through the very app `lmserve serve` serves
(`run_asgi`): auth, errors, SSE, metrics and every route behave as they do there. The replica yields a
`ResponseStart` and then the body's chunks as the app sends them, so streams stay streams.

The routing key is what the request router hashes: requests whose prompts agree on their first
`prefix_chars` characters get the same key, so they go to the same replica and its prefix cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

log = logging.getLogger("lmserve.deploy")

# Paths whose state lives on one replica's disk (batch jobs and their files, playground shares): they all
# share one key, so they reach the same replica while it lives.
STATEFUL_PREFIXES = {"/v1/files": "batch-api", "/v1/batches": "batch-api", "/playground/api": "playground"}


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request, read whole by the ingress; `routing_key` is None where any replica will do."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None
    routing_key: str | None = None
    replica: str | None = None  # the x-lmserve-replica request header: this replica if it is running


@dataclass(frozen=True)
class ResponseStart:
    """The status and headers of a response; its body chunks (bytes) follow it."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...] = field(default=())


def routing_key(path: str, body: bytes, prefix_chars: int) -> str | None:
    """The key requests that should share a replica share: a digest of the prompt's first `prefix_chars`
    characters on generation routes, a fixed one on routes with per-replica state, else None."""
    for prefix, key in STATEFUL_PREFIXES.items():
        if path == prefix or path.startswith(prefix + "/"):
            return key
    text = prompt_text(path, body)
    if text is None:
        return None
    return hashlib.sha256(text[:prefix_chars].encode("utf-8", "surrogatepass")).hexdigest()[:32]


def prompt_text(path: str, body: bytes) -> str | None:
    """The start of the text a generation request's prompt begins with; None for other routes or bad JSON
    (the replica's app answers those with its own 400)."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    if path == "/v1/chat/completions":
        return _messages_text(data.get("messages"))
    if path == "/v1/completions":
        return _prompt_text(data.get("prompt"))
    if path in ("/generate", "/generate_stream", "/"):
        return _prompt_text(data.get("inputs"))
    return None


def _prompt_text(prompt: Any) -> str | None:
    if isinstance(prompt, list) and prompt:  # a batch of prompts or one prompt as token ids: key on the first
        prompt = prompt[0] if not isinstance(prompt[0], int) else " ".join(map(str, prompt))
    if isinstance(prompt, list):
        prompt = " ".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else None


def _messages_text(messages: Any) -> str | None:
    """Role and text of each message in order: the part of the rendered prompt the template does not add."""
    if not isinstance(messages, list):
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if isinstance(content, list):  # content parts: their text in order
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role')}\x00{content if isinstance(content, str) else ''}\x00")
    return "".join(parts)


def asgi_scope(req: ForwardedRequest) -> dict:
    """The ASGI HTTP scope an app would get had the request reached it directly."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
            "query_string": req.query_string, "root_path": "", "headers": list(req.headers),
            "client": req.client, "server": ("lmserve-replica", 0), "state": {}}


_DONE = object()
_running: set[asyncio.Task] = set()  # apps still running after their caller left (they end on the disconnect)


async def run_asgi(app, req: ForwardedRequest, extra_headers: tuple[tuple[bytes, bytes], ...] = ()
                   ) -> AsyncIterator[ResponseStart | bytes]:
    """Run `req` through the ASGI `app`: yield its ResponseStart (with `extra_headers` added), then each
    non-empty body chunk. If the caller stops early (a client that left), the app sees http.disconnect."""
    queue: asyncio.Queue = asyncio.Queue()  # unbounded: a response is never held up by a slow reader here
    disconnected = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(_run(app, asgi_scope(req), receive, queue.put))
    _running.add(task)
    task.add_done_callback(_running.discard)
    try:
        while (message := await queue.get()) is not _DONE:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple(message.get("headers", ())) + extra_headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()  # the app's stream watcher aborts its engine request; the task then ends by itself


async def _run(app, scope: dict, receive, put) -> None:
    """The app, then the end marker; a crash before any response becomes a 500 (logged with its traceback)."""
    started = False

    async def send(message: dict) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await put(message)

    try:
        await app(scope, receive, send)
    except Exception:  # noqa: BLE001 - the app's own error handlers answer what they expect; this is a bug
        log.exception("the app raised on %s %s", scope["method"], scope["path"])
        if not started:
            body = json.dumps({"error": {"message": "internal error", "type": "internal_error",
                                         "param": None, "code": None}}).encode()
            await put({"type": "http.response.start", "status": 500,
                       "headers": [(b"content-type", b"application/json")]})
            await put({"type": "http.response.body", "body": body})
    finally:
        await put(_DONE)
