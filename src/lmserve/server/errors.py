"""Error bodies: OpenAI's shape on OpenAI routes, TGI's on TGI routes, Anthropic's on the Messages routes,
Ollama's ({"error": message}) under /api/.

Never a traceback or a path."""

from __future__ import annotations

from starlette.responses import JSONResponse

TGI_PATHS = ("/", "/generate", "/generate_stream", "/info")
TEI_PATHS = ("/embed",)  # Text Embeddings Inference: TGI's error body, its statuses as ours (a bad input is 400)
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
MAX_MESSAGE = 400  # characters of an error message (inputs are only ever quoted in short excerpts)

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                 413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
                 500: "internal_error"}
_TGI_TYPES = {400: "validation", 422: "validation", 401: "authentication", 403: "authentication", 404: "not_found",
              405: "validation", 413: "validation", 429: "overloaded", 503: "overloaded", 500: "generation"}
# Anthropic's error types by status (its docs' list; it answers overload with 529, we keep 503 and Retry-After).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


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


def excerpt(value: object, limit: int = 40) -> str:
    """A short, safe quotation of user input for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def is_tgi(path: str) -> bool:
    return path in TGI_PATHS


def is_anthropic(path: str) -> bool:
    return path in ANTHROPIC_PATHS


def is_ollama(path: str) -> bool:
    """An Ollama API path (/api/chat, /api/generate, /api/tags, ...): errors are {"error": message}."""
    return path.startswith("/api/")


def is_v2(path: str) -> bool:
    """A KServe v2 (Open Inference Protocol) path; other unknown /v2 paths keep OpenAI's shape."""
    return path.startswith(("/v2/models/", "/v2/health/"))


def error_response(path: str, err: APIError) -> JSONResponse:
    """The body and status for `err` in the route family of `path`."""
    if is_v2(path) or is_ollama(path):  # KServe's Open Inference Protocol and Ollama: {"error": message}
        return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)
    if is_anthropic(path):
        return JSONResponse(anthropic_error_body(err), status_code=err.status, headers=err.headers)
    status = 422 if is_tgi(path) and err.status == 400 else err.status  # TGI answers validation errors with 422
    return JSONResponse(error_body(err, tgi=is_tgi(path) or path in TEI_PATHS), status_code=status,
                        headers=err.headers)


def error_body(err: APIError, tgi: bool = False) -> dict:
    """OpenAI's error object, or TGI's; also what an SSE error event carries."""
    if tgi:
        return {"error": err.message, "error_type": _TGI_TYPES.get(err.status, "generation")}
    return {"error": {"message": err.message, "type": _OPENAI_TYPES.get(err.status, "invalid_request_error"),
                      "param": err.param, "code": err.code}}


def anthropic_error_body(err: APIError) -> dict:
    """Anthropic's error object; also what a Messages stream's `error` event carries."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(err.status, "api_error"), "message": err.message}}
