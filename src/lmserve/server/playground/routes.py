"""The playground's routes: the page (/, /playground, /p/<id>, its assets) and the share API under /playground/api.

The page's files hold no data, so they are served without an API key (a browser cannot send one when it
navigates); the page asks for the key and sends it on every data call. The share routes, /v1/models and
generation need the key like every other route.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from lmserve.server.errors import APIError
from lmserve.server.playground.store import ShareStore, ShareSummary
from lmserve.server.protocol import parse_body
from lmserve.server.quotas import QuotaExceeded
from lmserve.server.router import Router
from lmserve.server.state import key_name_of, quota_of, state_of

router = Router()
log = logging.getLogger("lmserve.server")
T = TypeVar("T")

STATIC = Path(__file__).parent / "static"
PAGE_PATHS = ("/", "/playground")
ASSETS = {"app.js": "text/javascript; charset=utf-8", "export.js": "text/javascript; charset=utf-8",
          "tokens.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
SHARE_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")  # store.new_share_id makes 22 of these
_PERMALINK = re.compile(r"/p/[A-Za-z0-9_-]{16,64}")
_ASSET = re.compile(r"/playground/assets/[a-z0-9_.-]{1,64}")
MAX_SHARE_BYTES = 1_000_000
SHARES = "/playground/api/shares"

# The page runs only its own scripts and talks only to this server; model output is never markup, and
# this is the second line of defence if a bug ever made it so. no-referrer: a permalink's id is its capability.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                "frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def is_public_page(method: str, path: str) -> bool:
    """A GET of the page or one of its files: served without an API key (they hold no data)."""
    return method == "GET" and (path in PAGE_PATHS or bool(_PERMALINK.fullmatch(path) or _ASSET.fullmatch(path)))


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)


class Alternative(_Body):
    """One of a position's top alternatives: its text and logprob."""

    token: str = Field(max_length=256)
    logprob: float


class SharedToken(_Body):
    """One generated token of the token view, with its top alternatives."""

    token: str = Field(max_length=256)
    logprob: float
    top: list[Alternative] = Field(default_factory=list, max_length=20)


class SharedOutput(_Body):
    text: str
    tokens: list[SharedToken] = Field(default_factory=list, max_length=16_384)
    finish_reason: str | None = Field(default=None, max_length=32)


class SharedParams(_Body):
    """The sampling parameters the page sets (null: the server's default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: list[str] = Field(default_factory=list, max_length=16)
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None


class ShareRequest(_Body):
    """What "Share" saves: the prompt, the parameters and the output, token view included. Never an API key."""

    mode: Literal["chat", "completion"]
    model: str = Field(max_length=256)
    system: str = ""
    prompt: str
    params: SharedParams
    output: SharedOutput
    title: str | None = Field(default=None, max_length=200)


@lru_cache(maxsize=None)
def _static(name: str) -> bytes:
    return (STATIC / name).read_bytes()


def _page(request: Request) -> Response:
    _store(request)  # with the playground off, the page is a 404 too
    return Response(_static("index.html"), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


@router.get("/")
async def index(request: Request) -> Response:
    return _page(request)


@router.get("/playground")
async def playground(request: Request) -> Response:
    return _page(request)


@router.get("/p/{share_id}")
async def permalink(request: Request, share_id: str) -> Response:
    """The page; its script reads the id from the address and fetches the share (with the API key)."""
    if not SHARE_ID.fullmatch(share_id):
        raise APIError(404, "no such share")
    return _page(request)


@router.get("/playground/assets/{name}")
async def asset(request: Request, name: str) -> Response:
    _store(request)
    if name not in ASSETS:
        raise APIError(404, f"no playground asset {name[:64]!r}")
    return Response(_static(name), media_type=ASSETS[name], headers=PAGE_HEADERS)


@router.post(SHARES)
async def create_share(request: Request) -> dict:
    store = _store(request)
    raw = await request.body()
    if len(raw) > MAX_SHARE_BYTES:
        raise APIError(413, f"a share holds at most {MAX_SHARE_BYTES} bytes of JSON, got {len(raw)}")
    req = parse_body(raw, ShareRequest)
    body = req.model_dump(mode="json", exclude={"title"})
    try:
        share = await _run(store.create, key_name_of(request), req.title or _title(req.prompt), req.mode, body,
                           quota_of(request))
    except QuotaExceeded as e:
        raise APIError(400, str(e), code="quota_exceeded") from None
    return _summary(share)


@router.get(SHARES)
async def list_shares(request: Request) -> dict:
    store = _store(request)
    shares = await _run(store.list, key_name_of(request))
    return {"object": "list", "data": [_summary(s) for s in shares]}


@router.get(SHARES + "/{share_id}")
async def get_share(request: Request, share_id: str) -> dict:
    """Any valid key may read a share by its id: the permalink is made to be passed on."""
    found = await _run(_store(request).get, share_id) if SHARE_ID.fullmatch(share_id) else None
    if found is None:
        raise APIError(404, "no such share (it may have been deleted)", code="share_not_found")
    share, body = found
    return {**_summary(share), **body}


@router.delete(SHARES + "/{share_id}")
async def delete_share(request: Request, share_id: str) -> dict:
    """Only the API key name that saved a share may delete it; anyone else gets the unknown id's 404."""
    deleted = SHARE_ID.fullmatch(share_id) and await _run(_store(request).delete, share_id, key_name_of(request))
    if not deleted:
        raise APIError(404, "no such share among the ones saved with this API key", code="share_not_found")
    return {"id": share_id, "object": "playground.share", "deleted": True}


def _store(request: Request) -> ShareStore:
    store = state_of(request).playground
    if store is None:
        raise APIError(404, "the playground is off (the server was started with --no-playground)")
    return cast(ShareStore, store)  # the middle types it by the one call it makes (state.Shares)


async def _run(fn: Callable[..., T], *args: Any) -> T:
    """A store call off the event loop; a broken file (disk full, locked, corrupt) is a 503, logged."""
    try:
        return await asyncio.to_thread(fn, *args)
    except sqlite3.Error as e:
        log.error("playground store: %s", e)
        raise APIError(503, "the playground store is unavailable; see the server log",
                       headers={"Retry-After": "5"}) from None


def _summary(share: ShareSummary) -> dict:
    return {"id": share.id, "object": "playground.share", "url": f"/p/{share.id}", "title": share.title,
            "mode": share.mode, "created": int(share.created)}


def _title(prompt: str) -> str:
    """The prompt's first non-empty line, cut to 80 characters."""
    line = next((ln.strip() for ln in prompt.splitlines() if ln.strip()), "")
    return (line[:79] + "…" if len(line) > 80 else line) or "(empty prompt)"
