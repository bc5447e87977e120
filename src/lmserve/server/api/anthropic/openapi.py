"""The OpenAPI rows of Anthropic's Messages routes, and the models of their answers."""

from __future__ import annotations

from typing import Any

from lmserve.server.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from lmserve.server.api.route_doc import GEN_ERRORS, JSON, SSE, Open, RouteDoc


class AnthropicErrorDetail(Open):
    type: str
    message: str


class AnthropicError(Open):
    """The error body of the Anthropic Messages routes (/v1/messages, /v1/messages/count_tokens)."""

    type: str
    error: AnthropicErrorDetail


class AnthropicUsage(Open):
    input_tokens: int  # the prompt tokens not read from the prefix cache
    output_tokens: int
    cache_read_input_tokens: int | None = None  # the prompt tokens read from the prefix cache
    cache_creation_input_tokens: int | None = None  # always 0: caching is automatic and costs nothing extra


class AnthropicMessage(Open):
    id: str
    type: str
    role: str
    model: str
    content: list[dict[str, Any]]  # thinking (with --reasoning-parser), text and tool_use blocks
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(Open):
    input_tokens: int


ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("post", "/v1/messages"): RouteDoc(MessagesRequest, AnthropicMessage, GEN_ERRORS, (JSON, SSE)),
    ("post", "/v1/messages/count_tokens"): RouteDoc(CountTokensRequest, TokenCount, (400, 401, 404, 413, 503)),
}
ERROR_MODEL = AnthropicError
