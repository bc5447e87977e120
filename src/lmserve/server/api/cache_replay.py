"""The routes' side of the response cache: look up before the engine, store after, replay a hit as a stream.

A hit answers with the stored response under a fresh `id` and `created` (a new response to the caller;
usage keeps the original token counts) and `x-lmserve-cache: hit`. A cacheable miss says `miss`; a request
that is not cacheable (sampled without a seed, `"cache": false`, `Cache-Control: no-cache`) says `bypass`.

The key names what answers (the weights' fingerprint, the adapter's content digest), and an answer is stored
only if the adapter that ran is the one the key was made for: an adapter unloaded and loaded again with other
weights between the lookup and the run never files its answer under its predecessor's key.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lmserve.request import LoRARequest
from lmserve.server.api import chunks
from lmserve.server.protocol import answer_neutral
from lmserve.server.response_cache import cache_key, cacheable
from lmserve.server.served import ModelState
from lmserve.server.state import key_name_of, quota_of

HEADER = "x-lmserve-cache"


@dataclass(frozen=True)
class Lookup:
    """What the route needs after a lookup: the key to store under (None: do not store) and the header value."""

    key: str | None
    status: str  # "miss" or "bypass" (a hit has already been answered)
    lora_digest: str = ""  # the content digest of the adapter the key names ("": the base model)
    owner: str = ""  # the API key's name: its entries count against its share of the cache
    owner_cap: int | None = None


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
    key = cache_key(answerer, key_name_of(request), request.url.path, body, answer_neutral(type(req)))
    stored = await cache.get(key)
    if stored is None:
        return Lookup(key, "miss", digest, key_name_of(request), quota_of(request).cache_entries), None
    fresh = {**stored, "id": stored["id"].split("-", 1)[0] + "-" + uuid.uuid4().hex, "created": int(time.time())}
    stream_options = body.get("stream_options") or {}
    if body.get("stream"):
        return None, _replay(fresh, bool(stream_options.get("include_usage")))
    return None, JSONResponse(fresh, headers={HEADER: "hit"})


async def store(st: ModelState, found: Lookup | None, response: Response, body: dict | None,
                ran: LoRARequest | None = None) -> Response:
    """Mark `response` with the lookup's outcome; store `body` (a complete non-streamed answer) on a miss, if the
    adapter that ran (`ran`) is the one the lookup's key names."""
    if found is None:
        return response
    response.headers[HEADER] = found.status
    ran_digest = "" if ran is None else getattr(ran.adapter, "digest", None)
    if found.key is not None and body is not None and response.status_code == 200 and ran_digest == found.lora_digest:
        await st.response_cache.put(found.key, body, found.owner, found.owner_cap)
    return response


def _lora_digest(st: ModelState, name: str | None) -> str | None:
    """The content digest of the adapter `name` picks ("" for the model itself or a route; None: none loaded)."""
    if name is None or name == st.model_name or name in st.splits:
        return ""
    loras = st.front.loras
    reg = loras.lookup(name) if loras is not None else None
    return None if reg is None else reg.digest


def _replay(answer: dict, include_usage: bool) -> StreamingResponse:
    return chunks.response(iter(chunks.replay(answer, include_usage)), {HEADER: "hit"})
