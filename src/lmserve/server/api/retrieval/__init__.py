"""Retrieval (routes.py; bodies in protocol.py): rerank (Jina / Cohere on /v1/rerank, /rerank and /v2/rerank, TEI's
on /rerank), vLLM's /v1/score and /classify, and TEI's /embed, whose errors are TEI's body (TGI's shape) with our
statuses (a bad input is a 400, as TEI answers it, not TGI's 422)."""

from __future__ import annotations

from starlette.responses import JSONResponse

from lmserve.server.api.dialect import Dialect
from lmserve.server.api.hf_body import error_body as tei_error_body
from lmserve.server.errors import APIError, respond


def error_response(err: APIError) -> JSONResponse:
    return respond(tei_error_body(err), err)


# like generation routes, the Observe middleware keeps a record of each (and settles the key's usage)
DIALECT = Dialect("retrieval", __name__,
                  generation_paths=("/v1/rerank", "/v2/rerank", "/rerank", "/v1/score", "/classify", "/embed"),
                  error_paths=("/embed",), error_response=error_response)
