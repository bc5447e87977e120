"""Ollama-compatible routes: /api/chat, /api/generate (NDJSON streams by default), /api/tags, /api/show, /api/ps,
/api/version, and HEAD / ("Ollama is running"); the model routes (/api/tags, /api/show, /api/ps) are in
models.py, included here.

Shapes only: a request is admitted through ModelState.start like every other family's, and its body's meaning
is in protocol.py. As Ollama does it: a chat with no messages (a generate with no prompt) only loads the
model, or unloads it with `keep_alive: 0`; `keep_alive` sets how long the model stays loaded once idle
(server/models/pool.py unloads it then, and the next request loads it again). The model is shared by every key,
so a request's keep_alive holds only within the operator's bounds (--keep-alive-max; shorter than --keep-alive
and 0 only from an admin key, or any key with --allow-unload; another key's 0 is a 403); the last object of an answer
has `done: true` and the durations in nanoseconds; errors are `{"error": message}` (errors.py), in-band on a
stream. GET / stays the playground's page (server/playground); only HEAD / answers as Ollama's root does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import lmserve
from lmserve.errors import EngineDeadError, StepFailedError
from lmserve.ops.record import RequestRecord
from lmserve.parsers.events import ContentDelta, ReasoningDelta, StreamEvent
from lmserve.parsers.output import OutputParser
from lmserve.parsers.reasoning import effort_budget
from lmserve.request import CompletionDelta, TokenLogprobs
from lmserve.sampling_params import SamplingParams
from lmserve.server.api.chat_plan import ChatPlan, plan_chat, with_budget
from lmserve.server.api.ollama import models as ollama_models
from lmserve.server.api.ollama.protocol import (
    ChatRequest,
    GenerateRequest,
    KeepAliveBody,
    chat_messages,
    keep_alive_seconds,
    sampling_params,
    think_kwargs,
    with_images,
)
from lmserve.server.api.tools import template_variables
from lmserve.server.errors import APIError
from lmserve.server.router import Router
from lmserve.server.served import Chat, ModelState, Prompt
from lmserve.server.state import key_name_of, read_request, record_of
from lmserve.server.streams import MergedStreams, StreamEncoder, Watched, encoded_stream, engine_error

router = Router()
router.include(ollama_models.router)
# The Ollama API level these routes follow (clients gate features on it: tools, think, logprobs).
OLLAMA_VERSION = "0.12.0"
NDJSON = "application/x-ndjson"


@dataclass
class Turn:
    """One answer being produced: what the final object reports, and where its time went."""

    model: str
    start: float  # monotonic, at the route's entry
    load_s: float  # reading the body and waiting for the model to be loaded
    prompt_ids: list[int]
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    last: CompletionDelta | None = None

    def add(self, d: CompletionDelta) -> None:
        self.text += d.text
        self.output_ids += d.token_ids
        self.logprobs += d.logprobs or []
        self.last = d

    def final(self) -> dict:
        """done, done_reason and the counts and durations (nanoseconds) of the final object."""
        d = self.last
        timings = d.timings if d is not None else None
        return {"done": True, "done_reason": "length" if d is not None and d.finish_reason == "length" else "stop",
                "total_duration": _ns(time.monotonic() - self.start), "load_duration": _ns(self.load_s),
                "prompt_eval_count": len(self.prompt_ids),
                "prompt_eval_duration": _ns(timings.prefill_s if timings else 0.0),
                "eval_count": d.num_output_tokens if d is not None else 0,
                "eval_duration": _ns(timings.decode_s if timings else 0.0)}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _now() -> str:
    """RFC 3339 in UTC, as Ollama writes created_at."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@router.head("/")
async def root() -> Response:
    """Ollama's liveness check (the CLI's heartbeat): 200, "Ollama is running" (a HEAD answer sends no body)."""
    return Response("Ollama is running", media_type="text/plain; charset=utf-8")


@router.get("/api/version")
async def version() -> dict:
    return {"version": OLLAMA_VERSION, "lmserve_version": lmserve.__version__}


@router.post("/api/chat")
async def chat(request: Request) -> Response:
    start = time.monotonic()
    st, req = await read_request(request, ChatRequest)
    keep = apply_keep_alive(request, st, req)
    if not req.messages:
        return _loaded(st, keep, {"message": {"role": "assistant", "content": ""}})
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    variables = template_variables(st.front.tokenizer.chat_template)
    plan = plan_chat(st, chat_messages(req.messages), tools, think_kwargs(req.think, variables), req.think is not False)
    params = sampling_params(req, st.config.token_limits, tools, plan.fmt.name, plan.sampling_fields())
    params = with_budget(params, plan, _think_budget(req.think, params.max_tokens))
    parser = plan.parser
    turn, merged = await _start(request, st, req, plan.chat, params, start)
    if not req.stream:
        if not await _collect(request, st, turn, merged):
            return Response(status_code=499)
        return JSONResponse({**_head(turn), "message": _message(turn.text, parser), **_logprobs(st, req, turn),
                             **turn.final()})
    return _ndjson(request, st, merged, _chat_lines(st, req, turn, merged, parser))


@router.post("/api/generate")
async def generate(request: Request) -> Response:
    start = time.monotonic()
    st, req = await read_request(request, GenerateRequest)
    keep = apply_keep_alive(request, st, req)
    if req.images and (req.raw or req.context):  # a text model says so first; images need the template's turn
        st.check_images(len(req.images), "images")
        raise APIError(400, "images need the chat template: not with raw or context", param="images")
    if req.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    if req.template:
        raise APIError(400, "template is not supported: the model's own chat template renders the prompt",
                       param="template")
    if not req.prompt and not req.context and not req.images:
        return _loaded(st, keep, {"response": ""})
    plan = None if req.raw else _generate_plan(st, req)
    params = sampling_params(req, st.config.token_limits, plan_fields=plan.sampling_fields() if plan else None)
    if plan is not None:
        params = with_budget(params, plan, _think_budget(req.think, params.max_tokens))
    parser = plan.parser if plan is not None else None
    turn, merged = await _start(request, st, req, await _generate_prompt(st, req, plan, record_of(request)), params,
                                start)
    context = {} if req.raw else {"context": turn.prompt_ids}  # with the answer's ids appended at the end
    if not req.stream:
        if not await _collect(request, st, turn, merged):
            return Response(status_code=499)
        if context:
            context["context"] = turn.prompt_ids + turn.output_ids
        thinking, response = _parts(turn.text, parser)
        return JSONResponse({**_head(turn), "response": response, **_thinking(thinking, parser),
                             **_logprobs(st, req, turn), **turn.final(), **context})
    return _ndjson(request, st, merged, _generate_lines(st, req, turn, merged, context, parser))


def _generate_plan(st: ModelState, req: GenerateRequest) -> ChatPlan:
    """A templated generate is a chat of `system` (when given) and the prompt, with no tools."""
    system = [{"role": "system", "content": req.system}] if req.system else []
    variables = template_variables(st.front.tokenizer.chat_template)
    user = {"role": "user", "content": with_images(req.prompt, req.images)}
    return plan_chat(st, [*system, user], [], think_kwargs(req.think, variables),
                     req.think is not False)


async def _generate_prompt(st: ModelState, req: GenerateRequest, plan: ChatPlan | None,
                           record: RequestRecord) -> Prompt:
    """The prompt as written (raw), or rendered by the chat template (the plan's chat); after `context`'s ids."""
    prompt: Prompt = req.prompt if plan is None else plan.chat
    if not req.context:
        return prompt
    ids = await (st.tokenize_chat(prompt.messages, record, prompt.template_kwargs) if isinstance(prompt, Chat)
                 else st.tokenize(prompt, record))
    return [*req.context, *ids]


def apply_keep_alive(request: Request, st: ModelState, req: KeepAliveBody) -> float | None:
    """Apply the request's keep_alive to its shared model, within the operator's bounds (pool.KeepAlive: cut to
    --keep-alive-max; below --keep-alive only for a key that may unload); returns the value that holds. Every
    Ollama body that names a model carries one: /api/chat, /api/generate, and /api/embed and /api/embeddings
    (server/api/embeddings/routes.py), so an embedder expires and unloads as a chat model does.

    An unload (0) from a key that may not make one is a 403: the model serves every key."""
    seconds = keep_alive_seconds(req)
    if seconds is False:
        return st.model.keep_alive
    may_shorten = st.model.policy.allow_unload or st.tenants.is_admin(key_name_of(request))
    if seconds == 0 and not may_shorten:
        raise APIError(403, "keep_alive 0 unloads the model for every key: only an admin key may (or start the "
                       "server with --allow-unload)", param="keep_alive", code="permission_denied")
    return st.model.keep_for(seconds, may_shorten=may_shorten)


def _loaded(st: ModelState, keep: float | None, body: dict) -> JSONResponse:
    """The answer to a request that only loads the model (it is, by now) or unloads it (keep_alive 0: once this
    response has ended, the pool unloads it)."""
    reason = "unload" if keep == 0 else "load"
    return JSONResponse({"model": st.model_name, "created_at": _now(), **body, "done": True, "done_reason": reason})


async def _start(request: Request, st: ModelState, req: ChatRequest | GenerateRequest, prompt: Prompt,
                 params: SamplingParams, start: float) -> tuple[Turn, MergedStreams]:
    """Admit through the one admission path (`req.model` may name a LoRA adapter); the time until now counts as
    the model's load."""
    load_s = time.monotonic() - start
    record = record_of(request)
    run = await st.start([prompt], params, record, model=req.model, id_prefix="ollama")
    record.stream = req.stream
    name = run.lora.name if run.lora is not None else st.model_name
    return Turn(name, start, load_s, run.ids[0]), run.merged


def _head(turn: Turn) -> dict:
    return {"model": turn.model, "created_at": _now()}


async def _collect(request: Request, st: ModelState, turn: Turn, merged: MergedStreams) -> bool:
    """Run the stream to its end into `turn`; False when the client went away first (its request was aborted)."""
    watch = Watched(request, merged, lambda: st.metrics.aborts.labels("client_disconnect").inc())
    try:
        async for _, d in merged:
            turn.add(d)
    except (StepFailedError, EngineDeadError) as e:
        st.metrics.aborts.labels("error").inc()
        raise engine_error(e) from None
    finally:
        watch.close()
    return not merged.cancelled


def _message(text: str, parser: OutputParser | None) -> dict:
    """The assistant message of a whole answer: reasoning split out into `thinking`, calls parsed out (arguments as
    objects)."""
    if parser is None:
        return {"role": "assistant", "content": text}
    parsed = parser.parse(text)
    content, calls = parsed.content, parsed.calls
    message: dict[str, Any] = {"role": "assistant", "content": content or "", **_thinking(parsed.reasoning, parser)}
    if calls:
        message["tool_calls"] = [{"function": {"name": c.name, "arguments": _object(c.arguments)}} for c in calls]
    return message


def _parts(text: str, parser: OutputParser | None) -> tuple[str, str]:
    """(thinking, answer) of a whole generate answer ("" for what is absent)."""
    if parser is None:
        return "", text
    parsed = parser.parse(text)
    return parsed.reasoning or "", parsed.content or ""


def _think_budget(think: bool | str | None, max_tokens: int | None) -> int | None:
    """`think` "low" / "medium" / "high" as a reasoning budget (parsers/reasoning.py EFFORT_BUDGETS); true thinks
    without one (as Ollama does), false does not think at all (no reasoning parser)."""
    return effort_budget(think, max_tokens) if isinstance(think, str) else None


def _thinking(thinking: str | None, parser: OutputParser | None) -> dict:
    """`thinking` when a reasoning parser split some out (Ollama leaves the field out otherwise)."""
    return {"thinking": thinking} if thinking and parser is not None and parser.reasoning is not None else {}


def _split(events: list[StreamEvent]) -> tuple[str, str]:
    """(thinking, answer text) of a streamer's events."""
    return ("".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            "".join(e.joined for e in events if isinstance(e, ContentDelta)))


def _object(arguments: str) -> dict:
    """A call's arguments as the object Ollama sends (the grammar makes them one; {} if a bug ever did not)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _logprobs(st: ModelState, req, turn: Turn, lps: list[TokenLogprobs] | None = None) -> dict:
    """Ollama's `logprobs` list when asked for: each token's text, logprob, bytes and top alternatives."""
    if not (req.logprobs or req.top_logprobs):
        return {}
    decode = st.front.tokenizer.decode

    def one(token_id: int, logprob: float) -> dict:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"logprobs": [{**one(lp.token_id, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}
                         for lp in (turn.logprobs if lps is None else lps)]}


ENCODER = StreamEncoder(lambda line: json.dumps(line, ensure_ascii=False) + "\n",
                         lambda err: json.dumps({"error": err.message}) + "\n")


def _ndjson(request: Request, st: ModelState, merged: MergedStreams, lines: AsyncIterator[dict]) -> StreamingResponse:
    """One JSON object per line; a failure part-way is an `{"error": ...}` line (the client raises it)."""
    return StreamingResponse(encoded_stream(request, st.metrics, merged, lines, ENCODER), media_type=NDJSON)


async def _chat_lines(st: ModelState, req: ChatRequest, turn: Turn, merged: MergedStreams,
                      parser: OutputParser | None) -> AsyncIterator[dict]:
    """A line per step's text (its thinking split out); with tools, the calls, whole, before the final line."""
    streamer = parser.streamer() if parser is not None else None
    async for _, d in merged:
        turn.add(d)
        thinking, text = ("", d.text) if streamer is None else _split(streamer.feed(d.text))
        if thinking or text or d.logprobs:
            yield {**_head(turn), "message": {"role": "assistant", "content": text, **_thinking(thinking, parser)},
                   **_logprobs(st, req, turn, d.logprobs or []), "done": False}
    if streamer is not None:
        thinking, tail = _split(streamer.finish())
        calls = _message(turn.text, parser).get("tool_calls")
        if thinking or tail or calls:
            yield {**_head(turn), "message": {"role": "assistant", "content": tail, **_thinking(thinking, parser),
                                              **({"tool_calls": calls} if calls else {})}, "done": False}
    yield {**_head(turn), "message": {"role": "assistant", "content": ""}, **turn.final()}


async def _generate_lines(st: ModelState, req: GenerateRequest, turn: Turn, merged: MergedStreams,
                          context: dict, parser: OutputParser | None) -> AsyncIterator[dict]:
    """A line per step's text, its thinking split out when a reasoning parser runs."""
    streamer = parser.streamer() if parser is not None else None
    async for _, d in merged:
        turn.add(d)
        thinking, text = ("", d.text) if streamer is None else _split(streamer.feed(d.text))
        if thinking or text or d.logprobs:
            yield {**_head(turn), "response": text, **_thinking(thinking, parser),
                   **_logprobs(st, req, turn, d.logprobs or []), "done": False}
    thinking, tail = ("", "") if streamer is None else _split(streamer.finish())
    if thinking or tail:
        yield {**_head(turn), "response": tail, **_thinking(thinking, parser), "done": False}
    if context:
        context["context"] = turn.prompt_ids + turn.output_ids
    yield {**_head(turn), "response": "", **turn.final(), **context}
