"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (JSON and SSE)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmserve.request import TokenLogprobs
from lmserve.sampling_params import SamplingParams
from lmserve.server.errors import APIError
from lmserve.server.params import chat_params, completion_params
from lmserve.server.protocol import MAX_PROMPTS, ChatRequest, CompletionRequest
from lmserve.server.state import ServerState, read_request, record_of, state_of
from lmserve.server.streams import MergedStreams, Watched

router = APIRouter()


@dataclass
class Choice:
    """One choice being accumulated for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    st = state_of(request)
    max_len = st.engine.max_model_len if st.async_engine else None
    return {"object": "list", "data": [{"id": st.config.served_model_name, "object": "model", "created": st.created,
                                        "owned_by": "lmserve", "max_model_len": max_len}]}


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    st, req = await read_request(request, CompletionRequest)
    params = completion_params(req)
    prompts = _prompts(req.prompt)
    record = record_of(request)
    ids_list = [await st.tokenize(p, record) for p in prompts]
    echoes = [await _echo(st, p) if req.echo else "" for p in prompts]
    # Nothing awaits from admission until the streams are counted in flight.
    max_tokens_each = st.admit(ids_list, params, record)
    rid = record.request_id = f"cmpl-{uuid.uuid4().hex}"
    merged = MergedStreams([st.generate(f"{rid}-{i}", ids, params, max_tokens, record, i * params.n)
                            for i, (ids, max_tokens) in enumerate(zip(ids_list, max_tokens_each))])
    meta = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": st.config.served_model_name}
    usage_prompt = sum(len(ids) for ids in ids_list)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = _completion_chunks(st, merged, meta, params, echoes, usage_prompt, include_usage)
        return _sse(request, st, merged, chunks)
    choices = await _collect(request, st, merged, params.n, len(ids_list))
    if choices is None:
        return Response(status_code=499)
    body = {**meta, "choices": [
        {"index": i, "text": echoes[i // params.n] + c.text, "finish_reason": c.finish_reason,
         "logprobs": _completion_logprobs(st, c.logprobs) if params.logprobs is not None else None}
        for i, c in enumerate(choices)], "usage": _usage(usage_prompt, choices)}
    return JSONResponse(body)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    st, req = await read_request(request, ChatRequest)
    params = chat_params(req)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    record = record_of(request)
    ids = await st.tokenize_chat(messages, record)
    [max_tokens] = st.admit([ids], params, record)
    rid = record.request_id = f"chatcmpl-{uuid.uuid4().hex}"
    merged = MergedStreams([st.generate(rid, ids, params, max_tokens, record)])
    meta = {"id": rid, "created": int(time.time()), "model": st.config.served_model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _sse(request, st, merged, _chat_chunks(st, merged, meta, params, len(ids), include_usage))
    choices = await _collect(request, st, merged, params.n, 1)
    if choices is None:
        return Response(status_code=499)
    body = {**meta, "object": "chat.completion", "choices": [
        {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
         "logprobs": {"content": _chat_logprobs(st, c.logprobs)} if req.logprobs else None}
        for i, c in enumerate(choices)], "usage": _usage(len(ids), choices)}
    return JSONResponse(body)


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


async def _echo(st: ServerState, prompt: str | list[int]) -> str:
    """The prompt as text: a string as sent, token ids decoded (off the event loop)."""
    return prompt if isinstance(prompt, str) else await asyncio.to_thread(st.engine.tokenizer.decode, prompt)


async def _collect(request: Request, st: ServerState, merged: MergedStreams, n: int,
                   num_prompts: int) -> list[Choice] | None:
    """Run every stream to the end; None when the client went away first (its requests were aborted)."""
    choices = [Choice() for _ in range(n * num_prompts)]
    watch = Watched(request, merged, lambda: st.metrics.aborts.labels("client_disconnect").inc())
    try:
        async for p, d in merged:
            c = choices[p * n + d.index]
            c.text += d.text
            c.token_ids += d.token_ids
            c.logprobs += d.logprobs or []
            if d.finished:
                c.finish_reason = d.finish_reason
    except APIError:
        raise
    except Exception as e:  # the engine died under us: not the client's fault
        st.metrics.aborts.labels("error").inc()
        raise APIError(503, f"generation failed: {type(e).__name__}") from None
    finally:
        watch.close()
    return None if merged.cancelled else choices


def _sse(request: Request, st: ServerState, merged: MergedStreams, chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Serve `chunks` as server-sent events ending in [DONE]; a disconnect aborts the streams."""
    watch = Watched(request, merged, lambda: st.metrics.aborts.labels("client_disconnect").inc())

    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except Exception as e:  # mid-stream failure: tell the client in-band, as OpenAI does
            st.metrics.aborts.labels("error").inc()
            err = {"error": {"message": f"generation failed: {type(e).__name__}", "type": "internal_error",
                             "param": None, "code": None}}
            yield f"data: {json.dumps(err)}\n\n"
        finally:
            watch.close()
            merged.stop()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _completion_chunks(st: ServerState, merged: MergedStreams, meta: dict, params: SamplingParams,
                             echoes: list[str], usage_prompt: int, include_usage: bool) -> AsyncIterator[dict]:
    n, offsets, outputs = params.n, {}, {}  # offsets: characters of each choice's text sent so far
    async for p, d in merged:
        i = p * n + d.index
        text = d.text if i in offsets else echoes[p] + d.text
        offset = offsets.get(i, 0)
        offsets[i] = offset + len(text)
        outputs[i] = d.num_output_tokens
        if not text and not d.finished and not d.logprobs:
            continue
        lp = _completion_logprobs(st, d.logprobs or [], offset) if params.logprobs is not None else None
        choice = {"index": i, "text": text, "finish_reason": d.finish_reason if d.finished else None, "logprobs": lp}
        yield {**meta, "choices": [choice]}
    if include_usage:
        yield {**meta, "choices": [], "usage": _usage_counts(usage_prompt, sum(outputs.values()))}


async def _chat_chunks(st: ServerState, merged: MergedStreams, meta: dict, params: SamplingParams,
                       prompt_tokens: int, include_usage: bool) -> AsyncIterator[dict]:
    base = {**meta, "object": "chat.completion.chunk"}
    for i in range(params.n):  # the first delta of each choice carries the role
        yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]}
    outputs = {}
    async for _, d in merged:
        outputs[d.index] = d.num_output_tokens
        lp = {"content": _chat_logprobs(st, d.logprobs or [])} if params.logprobs is not None else None
        if d.text or d.logprobs:
            yield {**base, "choices": [{"index": d.index, "delta": {"content": d.text}, "logprobs": lp,
                                        "finish_reason": None}]}
        if d.finished:
            yield {**base, "choices": [{"index": d.index, "delta": {}, "logprobs": None,
                                        "finish_reason": d.finish_reason}]}
    if include_usage:
        yield {**base, "choices": [], "usage": _usage_counts(prompt_tokens, sum(outputs.values()))}


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    return _usage_counts(prompt_tokens, sum(len(c.token_ids) for c in choices))


def _usage_counts(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_logprobs(st: ServerState, lps: list[TokenLogprobs], start: int = 0) -> dict:
    """The legacy completions format: parallel lists plus a dict of alternatives per position.

    text_offset counts characters from the start of the choice's text (`start` for a stream chunk).
    """
    piece = st.engine.tokenizer.id_to_piece
    tokens = [piece(t.token_id) for t in lps]
    offsets, pos = [], start
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [{piece(i): lp for i, lp in t.top} for t in lps], "text_offset": offsets}


def _chat_logprobs(st: ServerState, lps: list[TokenLogprobs]) -> list[dict]:
    piece = st.engine.tokenizer.id_to_piece

    def entry(token_id: int, logprob: float) -> dict:
        text = piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in lps]
