"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (JSON and SSE).

`start_completion` / `start_chat` turn a parsed body into engine streams for a `Caller`; the routes and
the batch jobs (`answer`, for server/batch/lines.py) both go through them, so a batch line is validated,
templated, sampled and refused exactly as the route would.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lmserve.beam_search import BeamSearch, BeamSearchSequence, advance_all, next_batch
from lmserve.errors import EngineDeadError, StepFailedError
from lmserve.ops.record import RequestRecord
from lmserve.parsers.output import OutputParser, Parsed
from lmserve.request import CompletionDelta, LoRARequest, TokenLogprobs
from lmserve.sampling_params import SamplingParams
from lmserve.server.api import cache_replay
from lmserve.server.api import chunks as sse
from lmserve.server.api.chat_plan import plan_chat
from lmserve.server.api.logprobs import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from lmserve.server.api.params import beam_params, chat_params, completion_params, scores_prompt_only, tool_dicts
from lmserve.server.api.tool_stream import chat_chunk_deltas
from lmserve.server.errors import APIError, error_body
from lmserve.server.protocol import MAX_PROMPTS, ChatRequest, CompletionRequest
from lmserve.server.router import Router
from lmserve.server.served import ModelState
from lmserve.server.state import ServerState, key_name_of, read_data, read_request, record_of, state_of
from lmserve.server.streams import MergedStreams, StreamEncoder, Watched, encoded_stream, engine_error

router = Router()


@dataclass
class Choice:
    """One choice being accumulated for a non-streaming response (or one stream chunk's worth)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # arrives with the completion's first delta
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def add(self, d: CompletionDelta) -> None:
        """Append one delta of this choice."""
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs or []
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


@dataclass(frozen=True)
class Prompt:
    """One prompt of a completions request."""

    ids: list[int]
    text: str  # what echo returns: the prompt as sent, token ids decoded


@dataclass(frozen=True)
class CompletionShape:
    """What a completions choice holds besides the generated text, as the request asked."""

    echo: bool = False
    logprobs: bool = False  # the legacy logprobs object; with echo, the prompt's tokens come first
    prompt_logprobs: bool = False  # vLLM's choice-level prompt_logprobs list
    score_only: bool = False  # echo with max_tokens 0: the one token the engine had to sample is dropped


@dataclass(frozen=True)
class Caller:
    """Who a generation is for: an HTTP request, or one line of a batch job (no connection to watch)."""

    record: RequestRecord  # its key_name is the tenant the scheduler is fair between
    request: Request | None = None  # watched for a disconnect (which aborts the streams); None for a batch line
    priority: int = 0  # Request.priority: batch lines wait behind interactive requests


def caller_of(request: Request) -> Caller:
    return Caller(record_of(request), request)


@dataclass
class Run:
    """A request admitted and its engine streams started: answered whole (`body`) or as SSE (`chunks`)."""

    merged: MergedStreams
    body: Callable[[], Awaitable[dict | None]]  # collects every stream; None when the client went away first
    chunks: Callable[[], AsyncIterator[dict]]
    lora: LoRARequest | None = None  # the adapter that runs (what the response cache may file its answer under)
    # A chat answer's first choice, content segments and calls in the order written, once `body` ran with a tool
    # parser (the Responses API's items follow it; the chat message joins the segments into `content`).
    parts: list = field(default_factory=list)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    """Every configured model, loaded or not (`loaded` says which), and every --route name; a key sees only
    the names it may use."""
    st = state_of(request)
    key = key_name_of(request)
    cards = [_model_card(st, name) for name in st.model_names() if st.tenants.allows(key, name)]
    return {"object": "list", "data": [*cards, *_adapter_cards(st, key)]}


def _adapter_cards(st: ServerState, key: str) -> list[dict]:
    """Each model's LoRA adapters that the key's `models` cover, `parent` naming the model: a loaded model's
    registered ones, an unloaded model's runtime ones that its next load registers again (`loaded: false`)."""
    cards = []
    for model in st.models.models.values():
        engine = model.async_engine
        if engine is None:
            names, loaded, max_len = st.adapter_owners.kept_names(model.name), False, model.spec.max_model_len
        elif engine.front.loras is not None:
            names, loaded, max_len = engine.front.loras.names(), True, engine.front.max_model_len
        else:
            continue
        cards += [{"id": name, "object": "model", "created": st.created, "owned_by": "lmserve",
                   "max_model_len": max_len, "loaded": loaded, "parent": model.name, "root": name}
                  for name in names if st.tenants.allows(key, name)]
    return cards


def _model_card(st: ServerState, name: str) -> dict:
    model = st.models.get(name)
    card = {"id": name, "object": "model", "created": st.created, "owned_by": "lmserve"}
    if model is None:  # a route: its models and weights
        split = st.splits[name]
        return {**card, "max_model_len": None, "route": [{"model": m, "weight": w} for m, w in split.targets]}
    engine = model.async_engine
    if engine is None:
        return {**card, "max_model_len": model.spec.max_model_len, "loaded": False, "parent": None, "root": name}
    # weight_format: how the weights are held (--quantization resolved: gguf | int8 | int4 | none)
    return {**card, "max_model_len": engine.front.max_model_len, "loaded": True, "parent": None, "root": name,
            "weight_format": engine.front.loaded.weight_format}


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, CompletionRequest, start_completion)


async def _serve(request: Request, body: type, start: Callable[..., Awaitable[Run]]) -> Response:
    """Read the body, answer from the response cache on a hit, else start the run and respond."""
    st, req = await read_request(request, body)
    found, hit = await cache_replay.lookup(request, st, req)
    if hit is not None:
        return hit
    return await _respond(request, st, found, req.stream, await start(st, req, caller_of(request)))


async def _respond(request: Request, st: ModelState, found: cache_replay.Lookup | None, stream: bool,
                   run: Run) -> Response:
    """A started run as SSE, or whole (stored in the response cache on a miss); 499 when the client left first."""
    if stream:
        return await cache_replay.store(st, found, _sse(request, st, run.merged, run.chunks()), None)
    body = await run.body()
    if body is None:
        return Response(status_code=499)
    return await cache_replay.store(st, found, JSONResponse(body), body, run.lora)


async def start_completion(st: ModelState, req: CompletionRequest, caller: Caller) -> Run:
    """Start every prompt's stream of a completions request through ModelState.start, the one admission path."""
    if req.use_beam_search:
        return await start_beam_search(st, req, caller)
    params = completion_params(req, st.config.token_limits)
    prompts = _prompts(req.prompt)
    run = await st.start(prompts, params, caller.record, model=req.model, id_prefix="cmpl", numbered=True,
                         priority=caller.priority, cache_salt=req.cache_salt)
    rid, ids_list, merged, lora = run.request_id, run.ids, run.merged, run.lora
    shape = CompletionShape(req.echo, params.logprobs is not None, req.prompt_logprobs is not None,
                            scores_prompt_only(req))
    texts = [await _echo(st, p) if req.echo else "" for p in prompts]
    meta = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": _model_name(st, lora)}
    usage_prompt = sum(len(ids) for ids in ids_list)
    inputs = [Prompt(ids, text) for ids, text in zip(ids_list, texts)]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def body() -> dict | None:
        choices = await collect(caller, st, merged, params.n, len(ids_list), shape.score_only)
        if choices is None:
            return None
        return {**meta, "choices": [_completion_choice(st, i, c, inputs[i // params.n], shape)
                                    for i, c in enumerate(choices)],
                "usage": _usage(usage_prompt, choices, caller.record.num_cached_tokens)}

    return Run(merged, body, lambda: _completion_chunks(st, merged, meta, params.n, inputs, shape, usage_prompt,
                                                        include_usage, caller.record), lora)


async def start_beam_search(st: ModelState, req: CompletionRequest, caller: Caller) -> Run:
    """vLLM's `use_beam_search`: best_of (or n) beams per prompt, the best n returned, never streamed.

    Each step runs every live beam as a one-token engine stream (beam_search.py); their prompt blocks come
    from the prefix cache, under the request's salt.
    """
    params = beam_params(req, st.config.token_limits)
    admitted = await st.admit_beams(_prompts(req.prompt), params.beam_width, params.max_tokens, caller.record,
                                    model=req.model, id_prefix="cmpl", priority=caller.priority,
                                    cache_salt=req.cache_salt)
    searches = [BeamSearch(ids, params, st.front.eos_token_ids, m) for ids, m in zip(admitted.ids, admitted.max_tokens)]
    meta = {"id": admitted.request_id, "object": "text_completion", "created": int(time.time()),
            "model": _model_name(st, admitted.lora)}

    async def body() -> dict | None:
        step = 0
        while (batch := next_batch(searches))[0]:
            streams = [st.generate(replace(admitted.request, request_id=f"{admitted.request_id}-{step}-{j}", prompt=seq,
                                           params=p, max_tokens=1), caller.record)
                       for j, (seq, p) in enumerate(zip(*batch))]
            choices = await collect(caller, st, MergedStreams(streams), 1, len(streams))
            if choices is None:
                return None
            advance_all(searches, [c.logprobs[0].top for c in choices])
            step += 1
        choices = [_beam_choice(st, s, seq) for s in searches for seq in s.finished[:req.n]]
        caller.record.outputs = []  # the payload log gets the returned beams, not the steps' tokens
        for i, c in enumerate(choices):
            out = caller.record.output(i)
            out.text, out.tokens, out.finish_reason = c.text, len(c.token_ids), c.finish_reason
        return {**meta, "choices": [_completion_choice(st, i, c, None, CompletionShape()) for i, c in enumerate(choices)],
                "usage": _usage(sum(len(ids) for ids in admitted.ids), choices)}

    async def no_chunks() -> AsyncIterator[dict]:  # beam_params refused stream
        return
        yield

    return Run(MergedStreams([]), body, no_chunks, admitted.lora)


def _beam_choice(st: ModelState, search: BeamSearch, seq: BeamSearchSequence) -> Choice:
    """A finished beam as a choice: its generated tokens, the text without the EOS (vLLM's
    include_stop_str_in_output false)."""
    tokens = seq.tokens[len(search.prompt):]
    shown = tokens[:-1] if seq.finish_reason == "stop" else tokens
    return Choice(st.front.tokenizer.decode(shown), tokens, finish_reason=seq.finish_reason,
                  stop_reason=seq.stop_reason)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, ChatRequest, start_chat)


async def start_chat(st: ModelState, req: ChatRequest, caller: Caller) -> Run:
    """The chat template's inputs (tools included), then ModelState.start, the one admission path."""
    tools = tool_dicts(req)  # empty when there are none or tool_choice is "none": replies are plain text
    plan = plan_chat(st, [m.model_dump(exclude_none=True) for m in req.messages], tools, req.chat_template_kwargs)
    params = chat_params(req, st.config.token_limits, plan.fmt, plan.sampling_fields())
    run = await st.start([plan.chat], params, caller.record, model=req.model,
                         id_prefix="chatcmpl", priority=caller.priority, cache_salt=req.cache_salt)
    rid, [ids], merged, lora = run.request_id, run.ids, run.merged, run.lora
    meta = {"id": rid, "created": int(time.time()), "model": _model_name(st, lora)}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    parser = plan.parser

    async def body() -> dict | None:
        choices = await collect(caller, st, merged, params.n, 1)
        if choices is None:
            return None
        parsed = [parser.parse(c.text) if parser is not None else None for c in choices]
        run.parts[:] = parsed[0].parts if parsed[0] is not None else []
        return {**meta, "object": "chat.completion", "choices": [
            {"index": i, **_chat_message(c, parser, parsed[i]),
             "logprobs": {"content": chat_logprobs(_piece(st), c.logprobs)} if req.logprobs else None}
            for i, c in enumerate(choices)],
            "usage": {**_usage(len(ids), choices, caller.record.num_cached_tokens),
                      **_reasoning_usage(st, parser, [c.token_ids for c in choices])}}

    run = Run(merged, body, lambda: _chat_chunks(st, merged, meta, params, len(ids), include_usage, parser,
                                                 caller.record), lora)
    return run


def _model_name(st: ModelState, lora: LoRARequest | None) -> str:
    """The `model` an answer names: the adapter's name when the request ran one, else the model that answered."""
    return lora.name if lora is not None else st.model_name


# The bodies a batch job's line may hold, by its `url`: the request model and how a route starts it.
BATCH_ENDPOINTS: dict[str, tuple[type, Callable[..., Awaitable[Run]]]] = {
    "/v1/completions": (CompletionRequest, start_completion),
    "/v1/chat/completions": (ChatRequest, start_chat),
}


async def answer(st: ServerState, url: str, data: Any, caller: Caller) -> tuple[int, dict]:
    """(status, JSON body) that the route at `url` answers for the parsed body `data`, never streamed.

    Every refusal is the route's own APIError in OpenAI's shape; only a bug escapes (the caller logs it).
    """
    leases: list = []
    try:
        model, start = BATCH_ENDPOINTS[url]
        bound, req = await read_data(st, data, model, caller.record, leases)
        if req.stream:
            raise APIError(400, "stream is not supported in a batch job", param="stream")
        run = await start(bound, req, caller)
        return 200, await run.body()
    except APIError as e:
        if e.reason is not None:
            st.metrics.rejected.labels(e.reason).inc()
        return e.status, error_body(e)
    finally:
        for held in leases:
            held.release()


def _chat_message(c: Choice, parser: OutputParser | None, parsed: Parsed | None) -> dict:
    """{"message", "finish_reason"} of a chat choice; with a parser, `parsed` is its text's reasoning and calls."""
    if parser is None or parsed is None:
        return {"message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parser.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    elif not parsed.calls:
        message["content"] = parsed.content or ""  # as without tools: a string
    if not parsed.calls:
        return {"message": message, "finish_reason": c.finish_reason}
    message["tool_calls"] = [call.to_openai() for call in parsed.calls]
    return {"message": message, "finish_reason": "tool_calls" if c.finish_reason == "stop" else c.finish_reason}


def _prompts(prompt: str | list) -> list[str | list[int]]:
    """Normalise the four accepted prompt forms to a list of single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
    return list(prompt)


async def _echo(st: ModelState, prompt: str | list[int]) -> str:
    """The prompt as text: a string as sent, token ids decoded (off the event loop)."""
    return prompt if isinstance(prompt, str) else await asyncio.to_thread(st.front.tokenizer.decode, prompt)


def _without_output(d: CompletionDelta) -> CompletionDelta:
    """A prompt-scoring delta (echo, max_tokens 0): the token the engine had to sample is not the caller's."""
    return replace(d, token_ids=[], text="", logprobs=None, num_output_tokens=0, stop_reason=None,
                   finish_reason="length" if d.finished else None)


async def collect(caller: Caller, st: ModelState, merged: MergedStreams, n: int,
                   num_prompts: int, score_only: bool = False) -> list[Choice] | None:
    """Run every stream to the end; None when the client went away first (its requests were aborted)."""
    choices = [Choice() for _ in range(n * num_prompts)]
    watch = Watched(caller.request, merged, lambda: st.metrics.aborts.labels("client_disconnect").inc())
    try:
        async for p, d in merged:
            choices[p * n + d.index].add(_without_output(d) if score_only else d)
    except (StepFailedError, EngineDeadError) as e:  # the engine failed under us: not the client's fault
        st.metrics.aborts.labels("error").inc()
        raise engine_error(e) from None
    finally:
        watch.close()
    return None if merged.cancelled else choices


# A failure part-way is an error event, then [DONE] (as vLLM; the openai client raises).
ENCODER = StreamEncoder(sse.event, lambda err: sse.event(error_body(err)), sse.DONE)


def _sse(request: Request, st: ModelState, merged: MergedStreams, chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Serve `chunks` as server-sent events ending in [DONE]; a disconnect aborts the streams."""
    return sse.response(encoded_stream(request, st.metrics, merged, chunks, ENCODER))


async def _completion_chunks(st: ModelState, merged: MergedStreams, meta: dict, n: int, prompts: list[Prompt],
                             shape: CompletionShape, usage_prompt: int, include_usage: bool,
                             record: RequestRecord) -> AsyncIterator[dict]:
    """A choice's first chunk carries the echoed prompt and the prompt's logprobs, later ones only new tokens."""
    offsets, outputs = {}, {}  # offsets: characters of each choice's text sent so far
    async for p, d in merged:
        i = p * n + d.index
        if shape.score_only:
            d = _without_output(d)
        first, c = i not in offsets, Choice()
        c.add(d)
        choice = _completion_choice(st, i, c, prompts[p] if first else None, shape, offsets.get(i, 0))
        offsets[i] = offsets.get(i, 0) + len(choice["text"])
        outputs[i] = d.num_output_tokens
        if choice["text"] or d.finished or c.logprobs or (first and (shape.echo or shape.prompt_logprobs)):
            yield sse.completion_chunk(meta, choice)
    if include_usage:
        yield sse.usage_chunk(meta, _usage_counts(usage_prompt, sum(outputs.values()), record.num_cached_tokens))


async def _chat_chunks(st: ModelState, merged: MergedStreams, meta: dict, params: SamplingParams,
                       prompt_tokens: int, include_usage: bool, parser: OutputParser | None,
                       record: RequestRecord) -> AsyncIterator[dict]:
    """Content deltas; with a parser, a streamer per choice turns reasoning and call text into OpenAI deltas."""
    base = {**meta, "object": "chat.completion.chunk"}
    for i in range(params.n):  # the first delta of each choice carries the role
        yield sse.role_chunk(base, i)
    outputs, token_ids = {}, {i: [] for i in range(params.n)}
    streamers = {i: parser.streamer() for i in range(params.n)} if parser is not None else None
    async for _, d in merged:
        outputs[d.index] = d.num_output_tokens
        token_ids[d.index] += d.token_ids if parser is not None and parser.reasoning is not None else []
        lp = {"content": chat_logprobs(_piece(st), d.logprobs or [])} if params.logprobs is not None else None
        deltas = [{"content": d.text}] if streamers is None else chat_chunk_deltas(streamers[d.index].feed(d.text))
        if (d.text and (deltas or streamers is None)) or d.logprobs:
            for k, delta in enumerate(deltas or [{}]):  # the logprobs go with the first
                yield sse.chat_chunk(base, d.index, delta, lp if k == 0 else None)
        if d.finished:
            reason = d.finish_reason
            if streamers is not None:
                for tail in chat_chunk_deltas(streamers[d.index].finish()):
                    yield sse.chat_chunk(base, d.index, tail)
                if streamers[d.index].num_calls and reason == "stop":
                    reason = "tool_calls"
            yield sse.chat_chunk(base, d.index, {}, None, reason)
    if include_usage:
        yield sse.usage_chunk(base, {**_usage_counts(prompt_tokens, sum(outputs.values()), record.num_cached_tokens),
                                     **_reasoning_usage(st, parser, list(token_ids.values()))})


def _usage(prompt_tokens: int, choices: list[Choice], cached: int | None = None) -> dict:
    return _usage_counts(prompt_tokens, sum(len(c.token_ids) for c in choices), cached)


def _reasoning_usage(st: ModelState, parser: OutputParser | None, outputs: list[list[int]]) -> dict:
    """`completion_tokens_details.reasoning_tokens` when a reasoning parser runs: every choice's reasoning tokens."""
    if parser is None or parser.reasoning is None:
        return {}
    decode = st.front.tokenizer.decode
    return {"completion_tokens_details": {"reasoning_tokens": sum(parser.reasoning.num_tokens(ids, decode)
                                                                  for ids in outputs)}}


def _usage_counts(prompt: int, completion: int, cached: int | None = None) -> dict:
    """OpenAI's usage; `cached`: of the prompt tokens, those served from the prefix cache (the request record's
    count, as the Responses API's input_tokens_details), as `prompt_tokens_details.cached_tokens`."""
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return usage if cached is None else {**usage, "prompt_tokens_details": {"cached_tokens": cached}}


def _completion_choice(st: ModelState, index: int, c: Choice, prompt: Prompt | None, shape: CompletionShape,
                       start: int = 0) -> dict:
    """A completions choice, or a stream chunk of one: `prompt` is given for a whole choice or its first chunk.

    `start` is the number of characters of the choice's text sent before this chunk.
    """
    echo = prompt is not None and shape.echo
    text = prompt.text if echo else ""
    body = {"index": index, "text": text + c.text, "finish_reason": c.finish_reason, "logprobs": None}
    if shape.logprobs:
        lp = completion_logprobs(_piece(st), [t.token_id for t in c.logprobs], c.logprobs, start + len(text))
        if echo:  # no prompt logprobs when the request ended before its prefill (aborted): nulls then
            prompt_lps = c.prompt_logprobs if c.prompt_logprobs is not None else [None] * len(prompt.ids)
            lp = {k: v + lp[k] for k, v in completion_logprobs(_piece(st), prompt.ids, prompt_lps, start).items()}
        body["logprobs"] = lp
    if shape.prompt_logprobs and prompt is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(_piece(st), c.prompt_logprobs)
    return body


def _piece(st: ModelState) -> Callable[[int], str]:
    return st.front.tokenizer.id_to_piece
