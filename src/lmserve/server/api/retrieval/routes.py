"""Retrieval routes: rerank (Jina / Cohere on /v1/rerank and /rerank, Cohere v2's client on /v2/rerank, TEI's on /rerank), score (vLLM's /v1/score),
classify (vLLM's /classify) and TEI's /embed.

Each text or pair is tokenized here and run as a pooling request through the one admission path (the same
`_embed` as /v1/embeddings): a cross-encoder's pair ([CLS] query [SEP] document [SEP]) comes back as its head's
sigmoid score, an embedder's texts as unit vectors whose dot product is their cosine similarity (vLLM's score
for embedding models). A model answers only its tasks (EngineFront.tasks); anything else is a 400 naming them.
An input past the model's window is a 400 unless `truncate_prompt_tokens` (TEI: `truncate`) asks to cut it; an
empty text, an empty list or more than --max-rerank-documents documents is a 400. This module only translates
shapes; errors on /embed are TEI's `{"error", "error_type"}` (server/errors.py), elsewhere OpenAI's.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from typing import Awaitable, Callable, NamedTuple

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lmserve.pooling_params import PoolingParams
from lmserve.server.api.embeddings.routes import _embed, cut_ids, require_task
from lmserve.server.api.retrieval.protocol import (
    ClassifyRequest,
    RerankRequest,
    ScoreRequest,
    TEIEmbedRequest,
    TEIRerankRequest,
)
from lmserve.server.api.vectors import VectorsResponse
from lmserve.server.errors import APIError
from lmserve.server.router import Router
from lmserve.server.served import ModelState
from lmserve.server.state import read_request

router = Router()
# like generation routes, the Observe middleware keeps a record of each (and settles the key's usage)
Text = str | tuple[str, str]  # one text, or a (query, document) pair for a cross-encoder


class _ClientGone(Exception):
    """The client disconnected while its inputs ran: nothing to answer (499)."""


def _answers_gone(route: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """A route whose client left mid-way answers 499 (no one reads it), as /v1/embeddings does."""
    @functools.wraps(route)
    async def run(request: Request) -> Response:
        try:
            return await route(request)
        except _ClientGone:
            return Response(status_code=499)
    return run


class Scored(NamedTuple):
    """Scores in input order, the tokens they took and the request id."""

    scores: list[float]
    tokens: int
    request_id: str


@router.post("/v1/rerank")
@_answers_gone
async def rerank_v1(request: Request) -> Response:
    st, req = await read_request(request, RerankRequest)
    return await _rerank(st, request, req)


@router.post("/v2/rerank")
@_answers_gone
async def rerank_v2(request: Request) -> Response:
    """Cohere's v2 client (cohere.ClientV2, LangChain's CohereRerank) posts here: the same body and answer."""
    st, req = await read_request(request, RerankRequest)
    return await _rerank(st, request, req)


@router.post("/rerank")
@_answers_gone
async def rerank(request: Request) -> Response:
    """Jina / Cohere's body, or TEI's (it sends `texts`, not `documents`)."""
    try:
        body = json.loads(await request.body())
    except ValueError:
        body = None  # read_request answers the malformed body
    if isinstance(body, dict) and "texts" in body and "documents" not in body:
        st, req = await read_request(request, TEIRerankRequest)
        return await _tei_rerank(st, request, req)
    st, req = await read_request(request, RerankRequest)
    return await _rerank(st, request, req)


async def _rerank(st: ModelState, request: Request, req: RerankRequest) -> Response:
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    scored = docs
    if req.max_tokens_per_doc is not None:  # Cohere v2: each document scored on its first tokens alone
        cut, n = st.front.tokenizer.cut_text, req.max_tokens_per_doc
        scored = await asyncio.to_thread(lambda: [cut(d, n) if d else d for d in docs])
    got = await _relevance(st, request, req.query, scored, req.model, req.truncate_prompt_tokens)
    order = sorted(range(len(docs)), key=lambda i: -got.scores[i])[:req.top_n or None]
    results = [{"index": i, "relevance_score": got.scores[i], **({"document": {"text": docs[i]}}
                                                                 if req.return_documents else {})} for i in order]
    return JSONResponse({"id": got.request_id, "model": st.model_name, "results": results,
                         "usage": {"total_tokens": got.tokens},
                         "meta": {"billed_units": {"search_units": 1}}})  # Cohere's clients read `meta`


async def _tei_rerank(st: ModelState, request: Request, req: TEIRerankRequest) -> Response:
    got = await _relevance(st, request, req.query, req.texts, req.model, True if req.truncate else None)
    order = sorted(range(len(req.texts)), key=lambda i: -got.scores[i])
    return JSONResponse([{"index": i, "score": _logit(got.scores[i]) if req.raw_scores else got.scores[i],
                          **({"text": req.texts[i]} if req.return_text else {})} for i in order])


@router.post("/v1/score")
@_answers_gone
async def score(request: Request) -> Response:
    st, req = await read_request(request, ScoreRequest)
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if len(first) == 1 and len(second) >= 1:
        first = first * len(second)  # one to many
    elif len(first) != len(second):
        raise APIError(400, f"text_1 ({len(first)} texts) and text_2 ({len(second)}) must be equally long, or "
                       "text_1 one text", param="text_2")
    got = await _pair_scores(st, request, list(zip(first, second)), req.model, req.truncate_prompt_tokens)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(got.scores)]
    return JSONResponse({"id": got.request_id, "object": "list", "created": int(time.time()), "model": st.model_name,
                         "data": data, "usage": _usage(got.tokens)})


@router.post("/classify")
@_answers_gone
async def classify(request: Request) -> Response:
    st, req = await read_request(request, ClassifyRequest)
    require_task(st, "classify")
    inputs = [req.input] if isinstance(req.input, str) else req.input
    ids = await _ids(st, inputs, req.truncate_prompt_tokens, "input")
    probs, rid = await _pooled(st, request, ids, req.model, PoolingParams(normalize=False))
    labels = st.front.pooler.labels
    data = [{"index": i, "label": labels[max(range(len(p)), key=p.__getitem__)], "probs": p, "num_classes": len(p)}
            for i, p in enumerate(probs)]
    return VectorsResponse({"id": rid, "object": "list", "created": int(time.time()), "model": st.model_name,
                            "data": data, "usage": _usage(sum(map(len, ids)))})


@router.post("/embed")
@_answers_gone
async def tei_embed(request: Request) -> Response:
    st, req = await read_request(request, TEIEmbedRequest)
    require_task(st, "embed")
    inputs = [req.inputs] if isinstance(req.inputs, str) else req.inputs
    ids = await _ids(st, inputs, True if req.truncate else None, "inputs")
    vectors, _ = await _pooled(st, request, ids, req.model, PoolingParams(req.dimensions, req.normalize))
    return VectorsResponse(vectors)


async def _relevance(st: ModelState, request: Request, query: str, docs: list[str], model: str | None,
                     truncate: int | bool | None) -> Scored:
    """Each document's relevance to `query`: the cross-encoder's score, or the embedder's cosine."""
    require_task(st, "rerank")
    return await _pair_scores(st, request, [(query, d) for d in docs], model, truncate)


async def _pair_scores(st: ModelState, request: Request, pairs: list[tuple[str, str]], model: str | None,
                       truncate: int | bool | None) -> Scored:
    require_task(st, "score")
    if not pairs:
        raise APIError(400, "documents must not be empty", param="documents")
    if len(pairs) > st.config.max_rerank_documents:
        raise APIError(400, f"at most {st.config.max_rerank_documents} documents in one request on this server "
                       f"(--max-rerank-documents), got {len(pairs)}", param="documents")
    if st.front.pooler.num_labels:  # a cross-encoder reads each pair whole
        ids = await _ids(st, pairs, truncate, "documents")
        scores, rid = await _pooled(st, request, ids, model, PoolingParams(normalize=False))
        return Scored([s[0] for s in scores], sum(map(len, ids)), rid)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
    ids = await _ids(st, texts, truncate, "documents")
    vectors, rid = await _pooled(st, request, ids, model, PoolingParams())
    at = {t: vectors[i] for i, t in enumerate(texts)}
    return Scored([sum(a * b for a, b in zip(at[q], at[d])) for q, d in pairs], sum(map(len, ids)), rid)


async def _ids(st: ModelState, texts: list[Text], truncate: int | bool | None, param: str) -> list[list[int]]:
    """Token ids of each text or pair (off the event loop); one past the window is cut with `truncate` (True: to
    the window), else a 400."""
    if not texts:
        raise APIError(400, f"{param} must not be empty", param=param)
    # each text runs as one engine request: more than the batch and the queue hold could never be admitted at once
    room = st.front.max_num_seqs + st.config.max_queued_requests
    if len(texts) > room:
        raise APIError(400, f"at most {room} texts in one request on this server (--max-num-seqs + "
                       f"--max-queued-requests), got {len(texts)}", param=param)
    if any(not t or isinstance(t, tuple) and not all(t) for t in texts):
        raise APIError(400, "every text must be non-empty", param=param)
    tok = st.front.tokenizer
    ids = await asyncio.to_thread(lambda: [tok.encode_pair(*t) if isinstance(t, tuple) else tok.encode(t)
                                           for t in texts])
    window = st.front.max_model_len
    limit = window if truncate is True or truncate is None else min(truncate, window)
    if truncate is None:
        long = next((i for i, x in enumerate(ids) if len(x) > window), None)
        if long is not None:
            raise APIError(400, f"input {long} has {len(ids[long])} tokens, past the model's window of {window} "
                           "(set truncate_prompt_tokens, or TEI's truncate, to cut it)", param=param)
    return [cut_ids(st, x, limit) for x in ids]


async def _pooled(st: ModelState, request: Request, ids: list[list[int]], model: str | None,
                  pooling: PoolingParams) -> tuple[list[list[float]], str]:
    vectors, rid = await _embed(st, request, ids, model, pooling)
    if vectors is None:  # the client left
        raise _ClientGone
    return vectors, rid


def _logit(p: float) -> float:
    """The head's raw score back from its sigmoid."""
    p = min(max(p, 1e-12), 1 - 1e-12)
    return math.log(p / (1 - p))


def _usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}

