"""Embeddings: OpenAI's POST /v1/embeddings, and Ollama's POST /api/embed and legacy POST /api/embeddings.

Each input is tokenized, admitted and run through the one admission path (ModelState.start) as a pooling
request: the engine prefills it in the same batches as generations, pools the final hidden states as the
model's checkpoint (or --pooling) says and frees its KV blocks; nothing is sampled. This module only
translates shapes. OpenAI's vectors are unit length (`dimensions` keeps the first d components, then scales
to unit length again), `encoding_format: base64` packs them as little-endian float32; Ollama's /api/embed is
unit length, its legacy /api/embeddings is not (as Ollama answers); their `keep_alive` holds as on Ollama's chat
(ollama/routes.py apply_keep_alive: within the operator's bounds, 0 from a key that may not unload a 403). Errors on
/api/* are Ollama's `{"error": "..."}` (server/errors.py shapes them by path).
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

import numpy as np
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from lmserve.errors import EngineDeadError, StepFailedError
from lmserve.pooling_params import PoolingParams
from lmserve.sampling_params import SamplingParams
from lmserve.server.api.ollama.routes import apply_keep_alive
from lmserve.server.api.vectors import VectorsResponse
from lmserve.server.errors import APIError
from lmserve.server.protocol import _NullMeansDefault
from lmserve.server.router import Router
from lmserve.server.served import ModelState
from lmserve.server.state import read_request, record_of
from lmserve.server.streams import Watched, engine_error

router = Router()
MAX_INPUTS = 2048  # inputs in one request (OpenAI's limit); the server's queue limit may be lower


class EmbeddingRequest(_NullMeansDefault):
    """OpenAI's embeddings body: `input` a string, a list of strings, token ids, or a list of token-id lists."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = Field(default=None, max_length=256)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # vLLM's: cut each input to this many tokens


class OllamaEmbedRequest(_NullMeansDefault):
    """Ollama's /api/embed body; `options` are accepted (the model's own settings apply), `keep_alive` holds."""

    model: str | None = None
    input: str | list[str]
    truncate: bool = True  # Ollama's default: cut an input longer than the context to fit; false: a 400
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class OllamaEmbeddingsRequest(_NullMeansDefault):
    """Ollama's legacy /api/embeddings body: one `prompt`, one raw (not normalised) vector."""

    model: str | None = None
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


@router.post("/v1/embeddings")
async def openai_embeddings(request: Request) -> Response:
    st, req = await read_request(request, EmbeddingRequest)
    inputs = [req.input] if isinstance(req.input, str) or _is_ids(req.input) else req.input
    ids = await _tokenized(st, request, inputs, truncate=req.truncate_prompt_tokens or False)
    vectors, rid = await _embed(st, request, ids, req.model, PoolingParams(_dimensions(req.dimensions)))
    if vectors is None:
        return Response(status_code=499)
    n = sum(map(len, ids))
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return VectorsResponse({"id": rid, "object": "list", "created": int(time.time()), "model": st.model_name,
                            "data": data, "usage": {"prompt_tokens": n, "total_tokens": n}})


@router.post("/api/embed")
async def ollama_embed(request: Request) -> Response:
    start = time.monotonic()
    st, req = await read_request(request, OllamaEmbedRequest)
    load_s = time.monotonic() - start  # reading the body and waiting for the model to be loaded
    apply_keep_alive(request, st, req)  # an embedder is shared like a chat model: the same bounds
    inputs = [req.input] if isinstance(req.input, str) else req.input
    ids = await _tokenized(st, request, inputs, truncate=req.truncate)
    vectors, _ = await _embed(st, request, ids, req.model, PoolingParams(_dimensions(req.dimensions)))
    if vectors is None:
        return Response(status_code=499)
    return VectorsResponse({"model": req.model or st.model_name, "embeddings": vectors,
                            "total_duration": _ns(time.monotonic() - start), "load_duration": _ns(load_s),
                            "prompt_eval_count": sum(map(len, ids))})


@router.post("/api/embeddings")
async def ollama_embeddings(request: Request) -> Response:
    st, req = await read_request(request, OllamaEmbeddingsRequest)
    apply_keep_alive(request, st, req)
    ids = await _tokenized(st, request, [req.prompt], truncate=True)
    vectors, _ = await _embed(st, request, ids, req.model, PoolingParams(normalize=False))
    if vectors is None:
        return Response(status_code=499)
    return VectorsResponse({"embedding": vectors[0]})


def require_task(st: ModelState, task: str) -> None:
    """A 400 naming the model's tasks when it does not answer `task` (a cross-encoder asked for embeddings)."""
    tasks = st.front.tasks
    if task not in tasks:
        raise APIError(400, f"model {st.model_name!r} does not support {task}; its tasks: {', '.join(tasks)}",
                       param="model")


def cut_ids(st: ModelState, ids: list[int], limit: int) -> list[int]:
    """`ids` cut to `limit` tokens: an encoder's keep their closing separator ([SEP], </s>), as its tokenizer cuts."""
    if len(ids) <= limit:
        return ids
    return ids[:limit - 1] + ids[-1:] if st.front.pooler.encoder and limit > 1 else ids[:limit]


async def _tokenized(st: ModelState, request: Request, inputs: list, truncate: bool | int) -> list[list[int]]:
    """Each input's token ids (checked against the vocabulary); with `truncate`, cut to the model's context (an int:
    to that many tokens, within it)."""
    require_task(st, "embed")
    if not inputs:
        raise APIError(400, "input must not be empty", param="input")
    limit = min(MAX_INPUTS, st.front.max_num_seqs + st.config.max_queued_requests)
    if len(inputs) > limit:
        raise APIError(400, f"at most {limit} inputs in one request on this server, got {len(inputs)}", param="input")
    if any(not x for x in inputs):
        raise APIError(400, "every input must be a non-empty string or token-id list", param="input")
    record = record_of(request)
    ids = [await st.tokenize(x, record) for x in inputs]
    if truncate is False:
        return ids
    limit = st.front.max_model_len if truncate is True else min(truncate, st.front.max_model_len)
    return [cut_ids(st, x, limit) for x in ids]


async def _embed(st: ModelState, request: Request, ids: list[list[int]], model: str | None,
                 pooling: PoolingParams) -> tuple[list[list[float]] | None, str]:
    """Admit every input as a pooling request and collect the vectors in input order (None: the client left)."""
    params = SamplingParams(max_tokens=1, pooling=pooling)
    run = await st.start(ids, params, record_of(request), model=model, id_prefix="embd", numbered=True)
    vectors: list[list[float] | None] = [None] * len(ids)
    watch = Watched(request, run.merged, lambda: st.metrics.aborts.labels("client_disconnect").inc())
    try:
        async for i, d in run.merged:
            if d.finished:
                vectors[i] = d.embedding
    except (StepFailedError, EngineDeadError) as e:  # the engine failed under us: 500 (one step) or 503 (dead)
        st.metrics.aborts.labels("error").inc()
        raise engine_error(e) from None
    finally:
        watch.close()
        run.merged.stop()  # after a failure, the other inputs' requests are aborted (finished ones: nothing)
    if run.merged.cancelled:
        return None, run.request_id
    if any(v is None for v in vectors):  # aborted by a shutdown
        raise APIError(503, "the request was aborted (the server is shutting down)", headers={"Retry-After": "1"})
    return vectors, run.request_id


def _dimensions(d: int | None) -> int | None:
    if d is not None and d < 1:
        raise APIError(400, f"dimensions must be a positive integer, got {d}", param="dimensions")
    return d


def _is_ids(value: list) -> bool:
    """A list of token ids (one prompt), not a list of prompts."""
    return bool(value) and isinstance(value[0], int)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64: the vector's little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
