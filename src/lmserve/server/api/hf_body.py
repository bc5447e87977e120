"""The error body of Hugging Face's servers, shared by two dialects: TGI's routes (server/api/tgi/) and TEI's /embed
(server/api/retrieval/) answer `{"error": ..., "error_type": ...}`. Torch- and pydantic-free, as a dialect's
`__init__` is (the StartGate answers errors with it while the routes load)."""

from __future__ import annotations

from lmserve.server.errors import APIError

_TYPES = {400: "validation", 422: "validation", 401: "authentication", 403: "authentication", 404: "not_found",
          405: "validation", 413: "validation", 429: "overloaded", 503: "overloaded", 500: "generation"}


def error_body(err: APIError) -> dict:
    """TGI's (and TEI's) error object; also what a TGI stream's error event carries."""
    return {"error": err.message, "error_type": _TYPES.get(err.status, "generation")}
