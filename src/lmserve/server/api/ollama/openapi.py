"""The OpenAPI rows of Ollama's routes, and the models of their answers: NDJSON unless "stream": false; errors
{"error": message}. HEAD / is Ollama's liveness check (GET / stays the playground's page). 403: a keep_alive of 0
from a key that may not unload."""

from __future__ import annotations

from typing import Any

from lmserve.server.api.ollama import protocol as ol
from lmserve.server.api.route_doc import JSON, NDJSON, TEXT, Open, RouteDoc, Version

OLLAMA_GEN = (400, 401, 403, 404, 413, 429, 500, 503)


class OllamaError(Open):
    """The error body of the Ollama routes (/api/...), also a stream's in-band error line."""

    error: str


class OllamaMessage(Open):
    role: str
    content: str
    thinking: str | None = None  # with --reasoning-parser, unless think is false
    tool_calls: list[dict[str, Any]] | None = None  # each {"function": {"name", "arguments": {...}}}


class _OllamaFinal(Open):
    """What the last object of an Ollama answer carries (durations in nanoseconds)."""

    model: str
    created_at: str
    done: bool
    done_reason: str | None = None  # stop | length | load | unload
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaChatResponse(_OllamaFinal):
    message: OllamaMessage


class OllamaGenerateResponse(_OllamaFinal):
    response: str
    thinking: str | None = None  # with --reasoning-parser, unless think is false or raw
    context: list[int] | None = None


class OllamaDetails(Open):
    format: str
    family: str
    parameter_size: str
    quantization_level: str


class OllamaModel(Open):
    name: str
    model: str
    size: int
    digest: str
    modified_at: str
    details: OllamaDetails


class OllamaTags(Open):
    models: list[OllamaModel]


class OllamaLoadedModel(OllamaModel):
    expires_at: str
    size_vram: int
    context_length: int


class OllamaPs(Open):
    models: list[OllamaLoadedModel]


class OllamaShow(Open):
    details: OllamaDetails
    model_info: dict[str, Any]
    template: str
    capabilities: list[str]


ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("post", "/api/chat"): RouteDoc(ol.ChatRequest, OllamaChatResponse, OLLAMA_GEN, (JSON, NDJSON)),
    ("post", "/api/generate"): RouteDoc(ol.GenerateRequest, OllamaGenerateResponse, OLLAMA_GEN, (JSON, NDJSON)),
    ("post", "/api/show"): RouteDoc(ol.ShowRequest, OllamaShow, (400, 401, 404, 413, 503)),
    ("get", "/api/tags"): RouteDoc(None, OllamaTags, (401,)),
    ("get", "/api/ps"): RouteDoc(None, OllamaPs, (401,)),
    ("get", "/api/version"): RouteDoc(None, Version, (401,)),
    ("head", "/"): RouteDoc(None, None, (401,), (TEXT,)),  # Ollama's "Ollama is running" (no body: HEAD)
}
ERROR_MODEL = OllamaError
