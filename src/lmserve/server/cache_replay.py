"""The routes' side of the response cache: look up before the engine, store after, replay a hit as a stream.

A hit answers with the stored response under a fresh `id` and `created` (a new response to the caller;
usage keeps the original token counts) and `x-lmserve-cache: hit`. A cacheable miss says `miss`; a request
that is not cacheable (sampled without a seed, `"cache": false`, `Cache-Control: no-cache`) says `bypass`.

The key names what answers (the weights' fingerprint, the adapter's content digest), and an answer is stored
only if the adapter that ran is the one the key was made for: an adapter unloaded and loaded again with other
weights between the lookup and the run never files its answer under its predecessor's key.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from lmserve.request import LoraRequest
from lmserve.server.response_cache import cache_key, cacheable
from lmserve.server.served import ModelState
from lmserve.server.state import key_name_of

HEADER = "x-lmserve-cache"


@dataclass(frozen=True)
class Lookup:
    """What the route needs after a lookup: the key to store under (None: do not store) and the header value."""

    key: str | None
    status: str  # "miss" or "bypass" (a hit has already been answered)
    lora_digest: str = ""  # the content digest of the adapter the key names ("": the base model)


async def lookup(request: Request, st: ModelState, req: BaseModel) -> tuple[Lookup | None, Response | None]:
    """(None, None) without a cache; (Lookup, None) on a miss or bypass; (None, response) on a hit."""
    cache = st.response_cache
    if cache is None:
        return None, None
    body = req.model_dump(exclude_unset=True, mode="json")
    if "no-cache" in request.headers.get("cache-control", "").lower() or not cacheable(body):
        return Lookup(None, "bypass"), None
    digest = _lora_digest(st, body.get("model"))
    answerer = None if digest is None else await cache.answerer(st.model_name, st.front, digest)
    if answerer is None:  # an adapter not loaded (now: the route answers 404), or weights that cannot be read
        return Lookup(None, "bypass"), None
    key = cache_key(answerer, key_name_of(request), request.url.path, body)
    stored = await cache.get(key)
    if stored is None:
        return Lookup(key, "miss", digest), None
    fresh = {**stored, "id": stored["id"].split("-", 1)[0] + "-" + uuid.uuid4().hex, "created": int(time.time())}
    stream_options = body.get("stream_options") or {}
    if body.get("stream"):
        return None, _replay(fresh, bool(stream_options.get("include_usage")))
    return None, JSONResponse(fresh, headers={HEADER: "hit"})


async def store(st: ModelState, found: Lookup | None, response: Response, body: dict | None,
                ran: LoraRequest | None = None) -> Response:
    """Mark `response` with the lookup's outcome; store `body` (a complete non-streamed answer) on a miss, if the
    adapter that ran (`ran`) is the one the lookup's key names."""
    if found is None:
        return response
    response.headers[HEADER] = found.status
    ran_digest = "" if ran is None else getattr(ran.adapter, "digest", None)
    if found.key is not None and body is not None and response.status_code == 200 and ran_digest == found.lora_digest:
        await st.response_cache.put(found.key, body)
    return response


def _lora_digest(st: ModelState, name: str | None) -> str | None:
    """The content digest of the adapter `name` picks ("" for the model itself or a route; None: none loaded)."""
    if name is None or name == st.model_name or name in st.splits:
        return ""
    loras = st.front.loras
    reg = loras.lookup(name) if loras is not None else None
    return None if reg is None else reg.digest


def _replay(response: dict, include_usage: bool) -> StreamingResponse:
    chunks = _chat_chunks(response) if response.get("object") == "chat.completion" else _completion_chunks(response)
    if include_usage:
        chunks.append({**_meta(response), "choices": [], "usage": response["usage"]})
    lines = [f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return StreamingResponse(iter(lines), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", HEADER: "hit"})


def _meta(response: dict) -> dict:
    kind = "chat.completion.chunk" if response.get("object") == "chat.completion" else "text_completion"
    return {"id": response["id"], "object": kind, "created": response["created"], "model": response["model"]}


def _completion_chunks(response: dict) -> list[dict]:
    """One chunk per choice: its whole text, logprobs and finish reason."""
    return [{**_meta(response), "choices": [choice]} for choice in response["choices"]]


def _chat_chunks(response: dict) -> list[dict]:
    """Per choice: the role, the content or tool calls, then the finish reason (as a live stream sends them)."""
    meta, chunks = _meta(response), []
    for c in response["choices"]:
        chunk = lambda delta, logprobs=None, reason=None: {**meta, "choices": [  # noqa: E731
            {"index": c["index"], "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
        message = c["message"]
        chunks.append(chunk({"role": "assistant", "content": ""}))
        if message.get("content"):
            chunks.append(chunk({"content": message["content"]}, c.get("logprobs")))
        if message.get("tool_calls"):
            chunks.append(chunk({"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]}))
        chunks.append(chunk({}, None, c["finish_reason"]))
    return chunks
