"""TGI-compatible routes: /generate, /generate_stream, /info, and POST / (TGI's compat route).

As TGI does, generated text keeps a matched stop sequence (OpenAI routes cut it off), a sampled
request without a seed is given one, reported in `details.seed`, and `inputs` is a raw prompt:
special-token strings in it ("<|im_start|>") become control tokens.
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import lmserve
from lmserve.errors import EngineDeadError, StepFailedError
from lmserve.request import CompletionDelta, TokenLogprobs
from lmserve.sampling_params import MAX_STOP_STRINGS, SamplingParams
from lmserve.server.api.tgi import error_body
from lmserve.server.api.tgi.protocol import TGICompatRequest, TGIRequest, tgi_params
from lmserve.server.router import Router
from lmserve.server.served import ModelState
from lmserve.server.state import read_request, record_of, state_of
from lmserve.server.streams import MergedStreams, StreamEncoder, Watched, encoded_stream, engine_error

router = Router()


@router.get("/info")
async def info(request: Request) -> dict:
    st = state_of(request)
    body = {"model_id": st.config.served_model_name, "max_best_of": 1, "max_stop_sequences": MAX_STOP_STRINGS,
            "router": "lmserve", "version": lmserve.__version__}
    if st.async_engine is None:  # still loading: what the engine decides is not known yet
        return body
    front = st.front
    return {**body, "model_dtype": str(front.dtype).removeprefix("torch."), "model_device_type": front.device.type,
            "max_input_tokens": front.max_model_len - 1, "max_total_tokens": front.max_model_len,
            "max_concurrent_requests": front.max_num_seqs + st.config.max_queued_requests}


@router.post("/generate")
async def generate(request: Request) -> Response:
    st, req = await read_request(request, TGIRequest)
    return await _generate(request, st, req)


@router.post("/generate_stream")
async def generate_stream(request: Request) -> Response:
    st, req = await read_request(request, TGIRequest)
    return await _generate_stream(request, st, req)


@router.post("/")
async def compat_generate(request: Request) -> Response:
    st, req = await read_request(request, TGICompatRequest)
    return await (_generate_stream if req.stream else _generate)(request, st, req)


async def _start(request: Request, st: ModelState, req: TGIRequest,
                 stream: bool) -> tuple[SamplingParams, list[int], MergedStreams]:
    """Admit through the one admission path; returns the params, the prompt's ids and the running stream."""
    params = tgi_params(req.parameters, stream, st.config.token_limits)
    record = record_of(request)
    # TGI/LoRAX name the adapter in the parameters
    run = await st.start([req.inputs], params, record, model=req.parameters.adapter_id, id_prefix="tgi")
    record.stream = stream
    return params, run.ids[0], run.merged


def _finish_reason(d: CompletionDelta) -> str:
    if d.finish_reason == "stop":
        return "stop_sequence" if isinstance(d.stop_reason, str) else "eos_token"
    return "length"  # "abort" only reaches a client when a shutdown cut it short


def _stop_text(d: CompletionDelta) -> str:
    """The matched stop sequence, which TGI keeps in the generated text."""
    return d.stop_reason if d.finished and isinstance(d.stop_reason, str) else ""


def _token(st: ModelState, token_id: int, lp: TokenLogprobs | None, text: str | None = None) -> dict:
    tok = st.front.tokenizer
    return {"id": token_id, "text": tok.id_to_piece(token_id) if text is None else text,
            "logprob": lp.logprob if lp is not None else None, "special": tok.is_special(token_id)}


def _prefill(st: ModelState, ids: list[int], lps: list[TokenLogprobs | None] | None) -> list[dict]:
    """details.prefill: each prompt token with its logprob (null for the first, or all if the engine sent none)."""
    piece = st.front.tokenizer.id_to_piece
    lps = lps if lps is not None else [None] * len(ids)
    return [{"id": t, "text": piece(t), "logprob": lp.logprob if lp is not None else None} for t, lp in zip(ids, lps)]


async def _generate(request: Request, st: ModelState, req: TGIRequest) -> Response:
    params, ids, merged = await _start(request, st, req, stream=False)
    text, tokens, last, prompt_lps = "", [], None, None
    watch = Watched(request, merged, lambda: st.metrics.aborts.labels("client_disconnect").inc())
    try:
        async for _, d in merged:
            prompt_lps = d.prompt_logprobs if d.prompt_logprobs is not None else prompt_lps
            text += d.text + _stop_text(d)
            lps = d.logprobs or []
            tokens += [_token(st, t, lps[k] if k < len(lps) else None) for k, t in enumerate(d.token_ids)]
            last = d
    except (StepFailedError, EngineDeadError) as e:  # the engine failed under us: 500 (one step) or 503 (dead)
        st.metrics.aborts.labels("error").inc()
        raise engine_error(e) from None
    finally:
        watch.close()
    if merged.cancelled or last is None:
        return Response(status_code=499)
    body: dict = {"generated_text": req.inputs + text if req.parameters.return_full_text else text}
    if req.parameters.details:
        body["details"] = {"finish_reason": _finish_reason(last), "generated_tokens": last.num_output_tokens,
                           "seed": params.seed, "tokens": tokens,
                           "prefill": _prefill(st, ids, prompt_lps) if req.parameters.decoder_input_details else []}
    return JSONResponse(body)


# TGI's SSE: `data:` with no space; a failure part-way is reported in-band, as TGI does.
ENCODER = StreamEncoder(lambda ev: f"data:{json.dumps(ev, ensure_ascii=False)}\n\n",
                         lambda err: f"data:{json.dumps(error_body(err))}\n\n")


async def _generate_stream(request: Request, st: ModelState, req: TGIRequest) -> Response:
    params, ids, merged = await _start(request, st, req, stream=True)

    async def events():
        text, index = "", 0
        async for _, d in merged:
            text += d.text + _stop_text(d)
            lps = d.logprobs or []
            for k, t in enumerate(d.token_ids):
                index += 1
                last = k == len(d.token_ids) - 1
                # A step's text belongs to its last token (the detokenizer may hold bytes back).
                token_text = d.text + _stop_text(d) if last else ""
                ev = {"index": index, "token": _token(st, t, lps[k] if k < len(lps) else None, token_text),
                      "generated_text": None, "details": None}
                if d.finished and last:
                    ev["generated_text"] = req.inputs + text if req.parameters.return_full_text else text
                    ev["details"] = {"finish_reason": _finish_reason(d), "generated_tokens": d.num_output_tokens,
                                     "seed": params.seed, "input_length": len(ids)}
                yield ev

    body = encoded_stream(request, st.metrics, merged, events(), ENCODER)
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
