"""KServe's Open Inference Protocol (v2) beside the OpenAI routes: health, model metadata and readiness, and text
inference, so platforms that speak v2 (KServe, Seldon, Triton clients) can call lmserve.

Inference takes one BYTES input named `text_input` (shape [n]: n prompts, each answered by one completion) and
answers one BYTES output `text_output` of the same shape. Generation parameters go in the request's
`parameters`: max_tokens, temperature, top_p, top_k, min_p, seed, stop and user (a --route's sticky key), with the
meanings and limits of /v1/completions, through which the request runs. Errors are `{"error": "..."}` (the
protocol's error object; server/errors.py shapes them by path).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lmserve.server.api.openai.routes import caller_of, start_completion
from lmserve.server.errors import APIError
from lmserve.server.protocol import MAX_PROMPTS, CompletionRequest, parse_body, parse_data
from lmserve.server.router import Router
from lmserve.server.state import LEASES_KEY, LOADING_KEY, accept, arrived_at, key_name_of, record_of, state_of

router = Router()
INPUT, OUTPUT, BYTES = "text_input", "text_output", "BYTES"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)


class V2Tensor(_Strict):
    """One input tensor; only BYTES text is accepted."""

    name: str = Field(max_length=64)
    shape: list[int] = Field(min_length=1, max_length=8)
    datatype: str = Field(max_length=16)
    parameters: dict[str, Any] | None = None
    data: list[Any] = Field(max_length=MAX_PROMPTS)


class V2RequestedOutput(_Strict):
    name: str = Field(max_length=64)
    parameters: dict[str, Any] | None = None


class V2Parameters(_Strict):
    """The generation parameters accepted (the rest of /v1/completions' stay at their defaults)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = Field(default=None, max_length=256)


class V2InferRequest(_Strict):
    """The protocol's inference request object."""

    id: str | None = Field(default=None, max_length=256)
    parameters: V2Parameters | None = None
    inputs: list[V2Tensor] = Field(min_length=1, max_length=1)
    outputs: list[V2RequestedOutput] | None = Field(default=None, max_length=1)


@router.get("/v2/health/live")
async def live() -> dict:
    """The process answers: it is live (a dead engine ends the process, see server/main.py)."""
    return {"live": True}


@router.get("/v2/health/ready")
async def ready(request: Request) -> Response:
    st = state_of(request)
    if st.ready:
        return JSONResponse({"ready": True})
    return JSONResponse({"error": "the server is not ready (loading, draining or its engine has stopped)"},
                        status_code=503)


@router.get("/v2/models/{name}")
async def metadata(request: Request, name: str) -> dict:
    st = state_of(request)
    _known(request, name)
    tensor = {"datatype": BYTES, "shape": [-1]}
    return {"name": name, "versions": [], "platform": "lmserve", "inputs": [{"name": INPUT, **tensor}],
            "outputs": [{"name": OUTPUT, **tensor}], "loaded": _is_loaded(st, name)}


@router.get("/v2/models/{name}/ready")
async def model_ready(request: Request, name: str) -> Response:
    """200 when the model is loaded and its engine alive; 503 otherwise (an unloaded one loads on its next request)."""
    st = state_of(request)
    _known(request, name)
    if st.ready and _is_loaded(st, name):
        return JSONResponse({"name": name, "ready": True})
    request.scope["state"][LOADING_KEY] = True  # an expected answer (it loads on demand), not a server error
    return JSONResponse({"error": f"model {name[:80]!r} is not loaded (it loads on its first inference request)"},
                        status_code=503)


@router.post("/v2/models/{name}/infer")
async def infer(request: Request, name: str) -> Response:
    st = state_of(request)
    await st.wait_ready(arrived_at(request))  # sent as the server starts: answered once the model is up
    req = parse_body(await request.body(), V2InferRequest)
    prompts = _prompts(req)
    params = req.parameters.model_dump(exclude_none=True) if req.parameters else {}
    completion = parse_data({"model": name, "prompt": prompts, **params}, CompletionRequest)
    leases = request.scope.setdefault("state", {}).setdefault(LEASES_KEY, [])
    bound = await accept(st, completion, record_of(request), key_name_of(request), leases)
    body = await (await start_completion(bound, completion, caller_of(request))).body()
    if body is None:
        return Response(status_code=499)
    choices = body["choices"]
    return JSONResponse({
        "model_name": body["model"], "id": req.id or body["id"],
        "parameters": {"finish_reason": [c["finish_reason"] for c in choices], **body["usage"]},
        "outputs": [{"name": OUTPUT, "datatype": BYTES, "shape": [len(choices)], "data": [c["text"] for c in choices]}],
    })


def _prompts(req: V2InferRequest) -> list[str]:
    """The text prompts of the one `text_input` BYTES tensor; a 400 naming what else was sent."""
    [tensor] = req.inputs
    if tensor.name != INPUT or tensor.datatype != BYTES:
        raise APIError(400, f"expected one input named {INPUT!r} of datatype {BYTES}, got {tensor.name[:64]!r} "
                       f"({tensor.datatype[:16]})")
    if len(tensor.shape) != 1 or tensor.shape[0] != len(tensor.data) or not tensor.data:
        raise APIError(400, f"{INPUT} must have shape [n] with n >= 1 matching its data (got shape {tensor.shape[:8]} "
                       f"for {len(tensor.data)} item(s))")
    if not all(isinstance(text, str) for text in tensor.data):
        raise APIError(400, f"{INPUT}'s data must be strings (BYTES holds text here)")
    if req.outputs and req.outputs[0].name != OUTPUT:
        raise APIError(400, f"the only output is {OUTPUT!r}, got {req.outputs[0].name[:64]!r}")
    return list(tensor.data)


def _known(request: Request, name: str) -> None:
    """404 for a name that is neither a served model nor a route, or one the key may not use."""
    st = state_of(request)
    st.tenants.check_model(key_name_of(request), name)  # first: the same 404 whether the name exists or not
    if st.models.get(name) is None and name not in st.splits:
        raise APIError(404, f"model {name[:80]!r} does not exist", code="model_not_found")


def _is_loaded(st, name: str) -> bool:
    """A model: loaded now; a route: every one of its models is."""
    split = st.splits.get(name)
    names = [m for m, _ in split.targets] if split is not None else [name]
    return all(st.models.get(n) is not None and st.models.get(n).loaded for n in names)
