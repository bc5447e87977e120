"""Anthropic's Messages API (routes.py; its bodies in protocol.py), with Anthropic's error body."""

from __future__ import annotations

from starlette.responses import JSONResponse

from lmserve.server.api.dialect import Dialect
from lmserve.server.errors import APIError, respond

# Anthropic's error types by status (its docs' list; it answers overload with 529, we keep 503 and Retry-After).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_body(err: APIError) -> dict:
    """Anthropic's error object; also what a Messages stream's `error` event carries."""
    return {"type": "error", "error": {"type": _TYPES.get(err.status, "api_error"), "message": err.message}}


def error_response(err: APIError) -> JSONResponse:
    return respond(error_body(err), err)


DIALECT = Dialect("anthropic", __name__, generation_paths=("/v1/messages",),
                  error_paths=("/v1/messages", "/v1/messages/count_tokens"), error_response=error_response)
