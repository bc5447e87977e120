"""OpenAI's Responses API: POST /v1/responses (JSON or typed SSE), GET and DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items.

Only shapes are translated here: a request becomes the chat request it means (input.py) and runs
through openai.start_chat, so templating, tools, structured output, admission (ModelState.start) and refusals
are the chat route's own; the chat answer, whole or streamed, becomes output items and the Response object
(output.py). With `store` (the default) the answer is kept per API key (store.py) and
`previous_response_id` continues it: that response's context and output come before the new input
(its `instructions` do not carry over, as in OpenAI's API).

With --reasoning-parser the reasoning comes first as a `reasoning` item (its text as one `reasoning_text` part) and
is counted in usage's `reasoning_tokens`.

Not offered: the response cache (--response-cache), background mode, `truncation: "auto"`, hosted tools,
reasoning summaries, replaying a stored response as a stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sqlite3
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lmserve.server.api import chunks as sse
from lmserve.server.api.openai.routes import Run, caller_of, start_chat
from lmserve.server.api.responses.input import ResponsesRequest, chat_messages, chat_request, input_items
from lmserve.server.api.responses.output import OutputItems, ResponseShell, output_of_chat, status_of, usage_of
from lmserve.server.api.responses.store import ResponseStore, StoredResponse
from lmserve.server.errors import APIError
from lmserve.server.protocol import ChatRequest, parse_data
from lmserve.server.quotas import StorageQuota
from lmserve.server.router import Router
from lmserve.server.served import ModelState
from lmserve.server.state import IGNORED_FIELDS_KEY, key_name_of, quota_of, read_request, record_of, state_of
from lmserve.server.streams import StreamEncoder, encoded_stream

router = Router()
log = logging.getLogger(__name__)
MAX_LIST = 100  # input items per page
# Chat's names for the fields an error may name, and the Responses API's.
_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "messages": "input",
          "response_format": "text.format", "structured_outputs": "text.format"}


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    st, req = await read_request(request, ResponsesRequest)
    store, owner, quota = state_of(request).responses, key_name_of(request), quota_of(request)
    items = input_items(req, st.config.strict_fields, request.scope["state"][IGNORED_FIELDS_KEY])
    previous = await _previous(store, req.previous_response_id, owner, quota.response_chain)
    context = (previous.context + previous.response["output"] if previous else []) + items
    caller = caller_of(request)
    messages = chat_messages(req.instructions, context)
    caller.record.messages = messages  # what the payload log, tracing and validation rules read
    try:
        chat = parse_data(chat_request(req, messages), ChatRequest)
        run = await start_chat(st, chat, caller)
    except APIError as e:
        raise _renamed(e) from None
    model = run.lora.name if run.lora is not None else st.model_name
    # The engine request's hex (chatcmpl-<hex>) names the response: one id in the logs and the answer.
    shell = ResponseShell("resp_" + caller.record.request_id.removeprefix("chatcmpl-"), model, req,
                          stored=req.store and store is not None)
    saved = _Saver(store if shell.stored else None, owner, items, previous, quota)
    if req.stream:
        return sse.response(_events(request, st, run, shell, saved))
    body = await run.body()
    if body is None:  # the client went away first
        return Response(status_code=499)
    choice, usage = body["choices"][0], body["usage"]
    output = output_of_chat(choice["message"], choice["finish_reason"], _output_items(shell.id), run.parts)
    answer = shell.object(status_of(choice["finish_reason"]), output, usage_of(usage, caller.record.num_cached_tokens))
    return JSONResponse(await saved(answer))


async def _previous(store: ResponseStore | None, response_id: str | None, owner: str,
                    chain_limit: int | None) -> StoredResponse | None:
    """The response a request continues (None without previous_response_id); 404 for an unknown one, 400 when the
    chain would grow past the key's limit (checked before any work)."""
    if response_id is None:
        return None
    found = None if store is None else await asyncio.to_thread(store.get, response_id, owner)
    if found is None:
        raise APIError(404, f"previous response with id {response_id[:80]!r} not found",
                       param="previous_response_id", code="previous_response_not_found")
    if chain_limit is not None and found.depth + 1 > chain_limit:
        raise APIError(400, f"previous_response_id continues a conversation of {found.depth} responses; this API key "
                       f"may chain at most {chain_limit}: start a new one (send the input items it needs)",
                       param="previous_response_id", code="quota_exceeded")
    return found


def _renamed(e: APIError) -> APIError:
    """A refusal of the chat request, in the Responses API's field names."""
    message, param = e.message, e.param
    for chat_name, name in _NAMES.items():
        message = message.replace(chat_name, name)
        if param is not None and param.split(".")[0] == chat_name:
            param = name + param[len(chat_name):]
    e.message, e.param = message, param
    return e


class _Saver:
    """Stores a finished Response object, linked to the one it continued (when it is to be stored); says so in its
    `store`."""

    def __init__(self, store: ResponseStore | None, owner: str, items: list[dict], previous: StoredResponse | None,
                 quota: StorageQuota) -> None:
        self.store, self.owner, self.items, self.previous, self.quota = store, owner, items, previous, quota

    async def __call__(self, answer: dict[str, Any]) -> dict[str, Any]:
        if self.store is None:
            return answer
        try:
            await asyncio.to_thread(self.store.put, self.owner, answer, self.items, self.previous, self.quota)
        except (sqlite3.Error, OSError) as e:  # the answer still goes out, saying it was not stored
            log.warning("could not store response %s: %s", answer["id"], e)
            return {**answer, "store": False}
        return answer


def _events(request: Request, st: ModelState, run: Run, shell: ResponseShell, save: _Saver) -> AsyncIterator[str]:
    """The typed events of a streamed response, numbered; a disconnect aborts the generation (nothing stored)."""
    numbers = itertools.count()
    out = _output_items(shell.id)

    def event(typed: tuple[str, dict[str, Any]]) -> str:
        kind, fields = typed
        return sse.typed_event({"type": kind, "sequence_number": next(numbers), **fields})

    def error(err: APIError) -> str:  # an error event, then response.failed (the client raises no HTTP error)
        failed = shell.object("failed", out.items, error={"code": "server_error", "message": err.message})
        return (event(("error", {"code": err.code or "server_error", "message": err.message, "param": None}))
                + event(("response.failed", {"response": failed})))

    events = _typed_events(request, run, shell, out, save)
    return encoded_stream(request, st.metrics, run.merged, events, StreamEncoder(event, error))


async def _typed_events(request: Request, run: Run, shell: ResponseShell, out: OutputItems,
                        save: _Saver) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    for kind in ("response.created", "response.in_progress"):
        yield kind, {"response": shell.object("in_progress", [])}
    finish, usage = None, None
    async for chunk in run.chunks():
        if not chunk["choices"]:  # the last chunk: usage
            usage = chunk["usage"]
            continue
        finish = chunk["choices"][0]["finish_reason"] or finish
        for kind, fields in _chat_delta(out, chunk["choices"][0]["delta"]):
            yield kind, fields
    if run.merged.cancelled:
        return
    status = status_of(finish)
    for kind, fields in out.finish(status):
        yield kind, fields
    answer = shell.object(status, out.items, usage_of(usage, record_of(request).num_cached_tokens))
    answer = await save(answer)
    yield "response.completed" if status == "completed" else "response.incomplete", {"response": answer}


def _output_items(response_id: str) -> OutputItems:
    """A response's output builder; its message and reasoning items are named by the response's own hex (one id in
    the logs and the answer)."""
    hex_id = response_id.removeprefix("resp_")
    return OutputItems("msg_" + hex_id, "rs_" + hex_id)


def _chat_delta(out: OutputItems, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The events of one chat chunk's delta: its reasoning, its text, then its tool_calls entries (a start,
    argument fragments)."""
    events = out.reasoning(delta["reasoning_content"]) if delta.get("reasoning_content") else []
    events += out.text(delta["content"]) if delta.get("content") else []
    for entry in delta.get("tool_calls") or []:
        if "id" in entry:
            events += out.call(entry["id"], entry["function"]["name"])
        if entry["function"].get("arguments"):
            events += out.arguments(entry["function"]["arguments"])
    return events


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> dict:
    return (await _stored(request, response_id)).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> dict:
    store = _store(request)
    if not await asyncio.to_thread(store.delete, response_id, key_name_of(request)):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str, after: str | None = None, limit: int = 20,
                           order: str = "desc") -> dict:
    """The items the response was generated from (earlier turns' inputs and outputs included), a page at a time."""
    if not 1 <= limit <= MAX_LIST:
        raise APIError(400, f"limit must be in 1..{MAX_LIST}, got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order[:20]!r}", param="order")
    items = (await _stored(request, response_id)).context
    items = items if order == "asc" else items[::-1]
    if after is not None:  # the page after that item; an unknown id is an empty page
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _store(request: Request) -> ResponseStore:
    store = state_of(request).responses
    if store is None:
        raise APIError(404, "stored responses are off on this server (see --responses-db)", code="not_found")
    return store


async def _stored(request: Request, response_id: str) -> StoredResponse:
    found = await asyncio.to_thread(_store(request).get, response_id, key_name_of(request))
    if found is None:
        raise _not_found(response_id)
    return found


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no response with id {response_id[:80]!r}", code="not_found")
