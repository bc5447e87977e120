"""TGI's API (/generate, /generate_stream, its POST /, /info: routes.py; its bodies and their parameters in
protocol.py), with TGI's error body and its 422 for invalid input."""

from __future__ import annotations

from starlette.responses import JSONResponse

from lmserve.server.api.dialect import Dialect
from lmserve.server.api.hf_body import error_body
from lmserve.server.errors import APIError, respond


def error_response(err: APIError) -> JSONResponse:
    return respond(error_body(err), err, 422 if err.status == 400 else None)  # TGI answers validation with 422


DIALECT = Dialect("tgi", __name__, generation_paths=("/generate", "/generate_stream", "/"),
                  error_paths=("/", "/generate", "/generate_stream", "/info"), error_response=error_response)
