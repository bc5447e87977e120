"""TGI-compatible routes: /generate, /generate_stream, /info."""

from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import lmserve
from lmserve.request import CompletionDelta
from lmserve.server.openai_routes import read_request, state_of
from lmserve.server.params import tgi_params
from lmserve.server.protocol import TGIRequest
from lmserve.server.state import ServerState
from lmserve.server.streams import MergedStreams, Watched

router = APIRouter()
_FINISH = {"length": "length", "abort": "length"}


@router.get("/info")
async def info(request: Request) -> dict:
    st = state_of(request)
    eng = st.engine if st.async_engine else None
    return {"model_id": st.config.served_model_name, "model_dtype": str(eng.dtype).removeprefix("torch.") if eng else None,
            "model_device_type": eng.device.type if eng else None, "max_input_tokens": eng.max_model_len - 1 if eng else None,
            "max_total_tokens": eng.max_model_len if eng else None, "max_best_of": 1, "max_stop_sequences": 16,
            "max_concurrent_requests": (eng.cfg.scheduler.max_num_seqs + st.config.max_queued_requests) if eng else None,
            "router": "lmserve", "version": lmserve.__version__}


async def _start(request: Request) -> tuple[ServerState, TGIRequest, list[int], MergedStreams]:
    st, req = await read_request(request, TGIRequest)
    params = tgi_params(req.parameters)
    ids = await st.tokenize(req.inputs)
    st.admit(ids, params)
    return st, req, ids, MergedStreams([st.generate(f"tgi-{uuid.uuid4().hex}", ids, params)])


def _finish_reason(d: CompletionDelta) -> str:
    if d.finish_reason == "stop":
        return "stop_sequence" if isinstance(d.stop_reason, str) else "eos_token"
    return _FINISH.get(d.finish_reason or "length", "length")


def _token(st: ServerState, token_id: int, logprob: float | None) -> dict:
    tok = st.engine.tokenizer
    return {"id": token_id, "text": tok.id_to_piece(token_id), "logprob": logprob, "special": tok.is_special(token_id)}


@router.post("/generate")
async def generate(request: Request) -> Response:
    st, req, ids, merged = await _start(request)
    text, tokens, last = "", [], None
    watch = Watched(request, merged, lambda: st.metrics.aborts.labels("client_disconnect").inc())
    try:
        async for _, d in merged:
            text += d.text
            lps = d.logprobs or []
            tokens += [_token(st, t, lps[k].logprob if k < len(lps) else None) for k, t in enumerate(d.token_ids)]
            last = d
    finally:
        watch.close()
    if merged.cancelled or last is None:
        return Response(status_code=499)
    full = req.inputs + text if req.parameters.return_full_text else text
    body: dict = {"generated_text": full}
    if req.parameters.details:
        body["details"] = {"finish_reason": _finish_reason(last), "generated_tokens": last.num_output_tokens,
                           "seed": req.parameters.seed, "prefill": [], "tokens": tokens}
    return JSONResponse(body)


@router.post("/generate_stream")
async def generate_stream(request: Request) -> Response:
    st, req, ids, merged = await _start(request)
    watch = Watched(request, merged, lambda: st.metrics.aborts.labels("client_disconnect").inc())

    async def events():
        text, index = "", 0
        try:
            async for _, d in merged:
                text += d.text
                lps = d.logprobs or []
                for k, t in enumerate(d.token_ids or []):
                    index += 1
                    last_token = k == len(d.token_ids) - 1
                    ev = {"index": index, "token": {**_token(st, t, lps[k].logprob if k < len(lps) else None),
                                                    "text": d.text if last_token else ""},
                          "generated_text": None, "details": None}
                    if d.finished and last_token:
                        ev["generated_text"] = req.inputs + text if req.parameters.return_full_text else text
                        ev["details"] = {"finish_reason": _finish_reason(d), "generated_tokens": d.num_output_tokens,
                                         "seed": req.parameters.seed}
                    yield f"data:{json.dumps(ev, ensure_ascii=False)}\n\n"
        except Exception as e:
            yield f"data:{json.dumps({'error': f'generation failed: {type(e).__name__}', 'error_type': 'generation'})}\n\n"
        finally:
            watch.close()
            merged.stop()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
