"""Anthropic's Messages API: POST /v1/messages (JSON and its typed SSE events), POST /v1/messages/count_tokens.

The request becomes the OpenAI chat the rest of the server knows (protocol.py), is admitted through
ModelState.start, the one admission path, and the answer is translated back: a thinking block (with
--reasoning-parser, unless `thinking` is disabled), text and tool_use content blocks, stop_reason end_turn /
max_tokens / stop_sequence / tool_use, usage. Tool calls use the OpenAI path's machinery
(api/tools.py: the prompt, the grammar that constrains calls, parsing; api/tool_stream.py while streaming), so
tool_choice any / tool generate schema-valid `input`. Errors are Anthropic's shape (server/errors.py by path), a
failure mid-stream an `error` event.

Usage: `input_tokens` counts the whole prompt (count_tokens gives the same number); the automatic prefix cache is
not reported as `cache_read_input_tokens`, which Anthropic bills apart and only for explicit cache_control.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lmserve.parsers.events import ContentDelta, ReasoningDelta, StreamEvent, ToolArgumentsDelta, ToolCallStart
from lmserve.parsers.output import OutputParser
from lmserve.sampling_params import SamplingParams
from lmserve.server.api import chunks as sse
from lmserve.server.api.anthropic import error_body
from lmserve.server.api.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_messages,
    openai_tool_choice,
    openai_tools,
)
from lmserve.server.api.chat_plan import ChatPlan, plan_chat, with_budget
from lmserve.server.api.openai.routes import caller_of, collect
from lmserve.server.api.params import build_params, structured_params, tool_structure
from lmserve.server.config import TokenLimits
from lmserve.server.router import Router
from lmserve.server.served import ModelState
from lmserve.server.state import read_request, record_of
from lmserve.server.streams import MergedStreams, StreamEncoder, encoded_stream

router = Router()
Event = tuple[str, dict]  # (SSE event name, its data); the name is the data's `type`
SIGNATURE = ""  # a thinking block's signature (see _thinking_block)


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    st, req = await read_request(request, MessagesRequest)
    caller = caller_of(request)
    plan = _plan(st, req)
    params = _params(req, plan, st.config.token_limits)
    run = await st.start([plan.chat], params, caller.record, model=req.model, id_prefix="msg",
                         priority=caller.priority)
    message = {"id": "msg_" + run.request_id.split("-", 1)[1], "type": "message", "role": "assistant",
               "model": run.lora.name if run.lora is not None else st.model_name}
    input_tokens = len(run.ids[0])
    if req.stream:
        return _sse(request, st, run.merged, _events(run.merged, message, input_tokens, plan.parser))
    choices = await collect(caller, st, run.merged, 1, 1)
    if choices is None:
        return Response(status_code=499)  # the client went away first
    c = choices[0]
    content, calls = _content(c.text, plan.parser)
    stop_reason, stop_sequence = _stop(c.finish_reason, c.stop_reason, calls)
    return JSONResponse({**message, "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                         "usage": {**_input_usage(input_tokens, caller.record.num_cached_tokens),
                                   "output_tokens": len(c.token_ids)}})


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict:
    """The prompt's tokens as /v1/messages would render them (system, messages, tools, each image's tokens)."""
    st, req = await read_request(request, CountTokensRequest)
    chat = _plan(st, req).chat
    return {"input_tokens": await st.count_chat(chat, record_of(request))}


def _plan(st: ModelState, req: CountTokensRequest) -> ChatPlan:
    """The chat as the OpenAI path builds it; `thinking` is the template's enable_thinking (Qwen3's; others ignore
    it), and "disabled" turns the reasoning parser off."""
    switch = {"enable_thinking": req.thinking.type == "enabled"} if req.thinking is not None else {}
    return plan_chat(st, chat_messages(req), openai_tools(req), switch)


def _params(req: MessagesRequest, plan: ChatPlan, limits: TokenLimits) -> SamplingParams:
    structured = None
    if plan.tools:
        parallel = not (req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use)
        spec = tool_structure(plan.tools, openai_tool_choice(req.tool_choice), parallel, plan.fmt.name)
        structured = structured_params(spec, "tools")
    params = build_params(max_tokens=limits.resolve(req.max_tokens, None, "max_tokens"), temperature=req.temperature,
                          top_p=req.top_p if req.top_p is not None else 1.0, top_k=req.top_k or 0,
                          stop=list(req.stop_sequences or []), structured_outputs=structured, **plan.sampling_fields())
    return with_budget(params, plan, req.thinking.budget_tokens if req.thinking is not None else None)


def _content(text: str, parser: OutputParser | None) -> tuple[list[dict], bool]:
    """The answer's content blocks (a thinking block when there is reasoning, then a text block per segment of text
    and a tool_use block per call, in the order written) and whether it called a tool."""
    if parser is None:
        return ([{"type": "text", "text": text}] if text else []), False
    parsed = parser.parse(text)
    blocks = [_thinking_block(parsed.reasoning)] if parsed.reasoning else []
    blocks += [{"type": "text", "text": part} if isinstance(part, str) else
               {"type": "tool_use", "id": _tool_use_id(part.id), "name": part.name, "input": json.loads(part.arguments)}
               for part in parsed.parts]  # the grammar made the arguments a JSON object of the tool's schema
    return blocks, bool(parsed.calls)


def _thinking_block(thinking: str) -> dict:
    """A thinking block; its signature is empty: Anthropic's is a seal only its servers check, and this server
    drops past thinking blocks from the prompt, so there is nothing to verify."""
    return {"type": "thinking", "thinking": thinking, "signature": SIGNATURE}


def _tool_use_id(call_id: str) -> str:
    """Anthropic's "toolu_" ids, from the OpenAI path's "call_" ones (same random part)."""
    return "toolu_" + call_id.removeprefix("call_")


def _stop(finish_reason: str | None, stop_reason: int | str | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence); a shutdown's abort reads as end_turn (Anthropic has no word for it)."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop_reason, str):  # a stop string (the engine cut it from the text, as Anthropic does)
        return "stop_sequence", stop_reason
    return "end_turn", None


@dataclass
class Blocks:
    """Turns reasoning / text / tool-call stream events into content_block_start / _delta / _stop events, one block
    at a time; a thinking block ends with its signature_delta (as Anthropic sends one before the block's stop)."""

    index: int = -1
    open: str | None = None  # the type of the block now open
    out: list[Event] = field(default_factory=list)

    def feed(self, events: list[StreamEvent]) -> list[Event]:
        for e in events:
            if isinstance(e, ReasoningDelta):
                if self.open != "thinking":
                    self._start(_thinking_block(""))
                self._delta({"type": "thinking_delta", "thinking": e.text})
            elif isinstance(e, ContentDelta):
                if self.open != "text":
                    self._start({"type": "text", "text": ""})
                self._delta({"type": "text_delta", "text": e.text})
            elif isinstance(e, ToolCallStart):
                self._start({"type": "tool_use", "id": _tool_use_id(e.id), "name": e.name, "input": {}})
            elif isinstance(e, ToolArgumentsDelta):
                self._delta({"type": "input_json_delta", "partial_json": e.text})
        out, self.out = self.out, []
        return out

    def close(self) -> list[Event]:
        """End the open block (a thinking block with its signature first); [] when none is open."""
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(self._delta_event({"type": "signature_delta", "signature": SIGNATURE}))
        self.open = None
        return events + [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict) -> None:
        self.out += self.close()
        self.index += 1
        self.open = block["type"]
        self.out.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block}))

    def _delta(self, delta: dict) -> None:
        self.out.append(self._delta_event(delta))

    def _delta_event(self, delta: dict) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}


async def _events(merged: MergedStreams, message: dict, input_tokens: int,
                  parser: OutputParser | None) -> AsyncIterator[Event]:
    """message_start, ping, the content blocks' events, message_delta (stop_reason, usage), message_stop.

    With a reasoning parser (--reasoning-parser) the parser's streamer splits each delta's text into thinking and
    answer text before the tool stage; the thinking goes out first, as a `thinking` block of thinking_delta events.
    """
    yield "message_start", {"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {**_input_usage(input_tokens, 0), "output_tokens": 0}}}
    yield "ping", {"type": "ping"}
    blocks, streamer = Blocks(), parser.streamer() if parser is not None else None
    last = None
    async for _, d in merged:
        events = streamer.feed(d.text) if streamer is not None else [ContentDelta(d.text)] if d.text else []
        if d.finished and streamer is not None:
            events += streamer.finish()
        for event in blocks.feed(events):
            yield event
        last = d if d.finished else last
    if last is None:  # cancelled: the client has gone
        return
    for event in blocks.close():
        yield event
    stop_reason, stop_sequence = _stop(last.finish_reason, last.stop_reason, bool(streamer and streamer.num_calls))
    yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                               "stop_sequence": stop_sequence},
                            "usage": {**_input_usage(input_tokens, last.num_cached_tokens),
                                      "output_tokens": last.num_output_tokens}}
    yield "message_stop", {"type": "message_stop"}


def _input_usage(prompt_tokens: int, cached: int) -> dict:
    """Anthropic's input counts: input_tokens + cache_read_input_tokens + cache_creation_input_tokens is the whole
    prompt. Reads are the prompt tokens served from the prefix cache; creation is 0, as prefix caching here is
    automatic and free (no cache_control breakpoints, nothing written that costs more). A stream's message_start
    cannot know the reads yet (they are found when the prompt is scheduled): it counts the whole prompt as input,
    and message_delta gives the final counts (the SDK's stream keeps the last)."""
    return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


# A failure part-way is an `error` event, as Anthropic's own; the client raises it.
ENCODER = StreamEncoder(lambda event: sse.named_event(*event),
                         lambda err: sse.named_event("error", error_body(err)))


def _sse(request: Request, st: ModelState, merged: MergedStreams, events: AsyncIterator[Event]) -> StreamingResponse:
    """Serve `events` as named server-sent events; a failure part-way is an `error` event; a disconnect aborts."""
    return sse.response(encoded_stream(request, st.metrics, merged, events, ENCODER))
