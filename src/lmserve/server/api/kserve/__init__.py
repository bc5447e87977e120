"""KServe v2, the Open Inference Protocol (routes.py), with its error body {"error": message}; other unknown /v2
paths keep OpenAI's."""

from __future__ import annotations

import re

from starlette.responses import JSONResponse

from lmserve.server.api.dialect import Dialect
from lmserve.server.errors import APIError, respond

INFER_PATH = re.compile(r"^/v2/models/[^/]+/infer$")  # the Observe middleware records these as generation requests


def error_response(err: APIError) -> JSONResponse:
    return respond({"error": err.message}, err)


DIALECT = Dialect("kserve", __name__, generation_pattern=INFER_PATH, error_prefixes=("/v2/models/", "/v2/health/"),
                  error_response=error_response, open_paths=("/v2/health/live", "/v2/health/ready"))
