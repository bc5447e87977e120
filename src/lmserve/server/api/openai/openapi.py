"""The OpenAPI rows of OpenAI's completions, chat and model list routes, and the models of their answers."""

from __future__ import annotations

from typing import Any

from lmserve.server import protocol as p
from lmserve.server.api.route_doc import GEN_ERRORS, JSON, SSE, Open, RouteDoc


class Usage(Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # cached_tokens: prompt tokens from the prefix cache


class CompletionChoice(Open):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class Completion(Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(Open):
    role: str
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(Open):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class ChatCompletion(Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(Open):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int | None
    parent: str | None = None  # a LoRA adapter's base model; None for the base itself
    root: str | None = None
    weight_format: str | None = None  # a loaded model: gguf | int8 | int4 | none (--quantization, auto resolved)


class ModelList(Open):
    object: str
    data: list[ModelCard]


ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("get", "/v1/models"): RouteDoc(None, ModelList, (401,)),
    ("post", "/v1/completions"): RouteDoc(p.CompletionRequest, Completion, GEN_ERRORS, (JSON, SSE)),
    ("post", "/v1/chat/completions"): RouteDoc(p.ChatRequest, ChatCompletion, GEN_ERRORS, (JSON, SSE)),
}
ERROR_MODEL = None
# the bodies whose fields a validation rule may name (server/main.py rule_params)
RULE_MODELS = (p.CompletionRequest, p.ChatRequest)
