"""Ollama's API under /api/ (routes.py: chat, generate, version, HEAD /; models.py: tags, show, ps; the bodies in
protocol.py), with Ollama's error body {"error": message}, also a stream's in-band error line."""

from __future__ import annotations

from starlette.responses import JSONResponse

from lmserve.server.api.dialect import Dialect
from lmserve.server.errors import APIError, respond


def error_response(err: APIError) -> JSONResponse:
    return respond({"error": err.message}, err)


DIALECT = Dialect("ollama", __name__, generation_paths=("/api/chat", "/api/generate"), error_prefixes=("/api/",),
                  error_response=error_response)
