"""APIError, and OpenAI's error body: the one every path gets unless its dialect answers in its own (each
server/api/<dialect>/ declares its paths and body; server/api/dialects.py's error_response picks by path).

Never a traceback or a path."""

from __future__ import annotations

import reprlib

from starlette.responses import JSONResponse

MAX_MESSAGE = 400  # characters of an error message (inputs are only ever quoted in short excerpts)

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                 413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
                 500: "internal_error"}


# OpenAI's `code` for a prompt past the model's context (its SDKs and agent frameworks match on it); the other
# families' bodies have no code field and keep their shape.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class APIError(Exception):
    """An error to answer with `status` and a clear message; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        # Why the request was refused, for lmserve:requests_rejected_total (a closed set; see metrics.py).
        self.reason = reason or ("invalid_request" if 400 <= status < 500 else None)
        self.status, self.message, self.code = status, message[:MAX_MESSAGE], code
        self.param = param[:100] if param else param  # a field path can hold a client's dict key
        self.headers = headers or {}


def _bounded_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxdict, r.maxlist, r.maxtuple, r.maxset = 3, 8, 8, 8, 8
    r.maxstring = r.maxother = r.maxlong = 200
    return r


_BOUNDED = _bounded_repr()


def excerpt(value: object, limit: int = 40) -> str:
    """A short, safe quotation of user input for an error message.

    Containers through reprlib: the full repr of a refused 100k-key logit_bias took 90 ms of held GIL per request,
    to keep its first 40 characters."""
    text = repr(value[:limit + 1]) if isinstance(value, str) else \
        _BOUNDED.repr(value) if isinstance(value, (dict, list, tuple, set, frozenset)) else repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def respond(body: dict, err: APIError, status: int | None = None) -> JSONResponse:
    """`body` answered with `err`'s status (or `status`) and headers."""
    return JSONResponse(body, status_code=status or err.status, headers=err.headers)


def error_body(err: APIError) -> dict:
    """OpenAI's error object; also what an SSE error event carries."""
    return {"error": {"message": err.message, "type": _OPENAI_TYPES.get(err.status, "invalid_request_error"),
                      "param": err.param, "code": err.code}}
