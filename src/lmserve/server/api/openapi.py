"""The served OpenAPI document: every route with its request body, its answer and its error bodies.

Routes read their bodies themselves (strict parsing in protocol.parse_body) and answer plain dicts, so
FastAPI sees neither; this module adds both to the generated document, once, on the first
/openapi.json (server/app.py imports it only then: building its models is no part of a start). The
response models here describe what the routes answer (extra fields allowed: the document promises
fields, not their absence); a fuzzer checks every answer against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, RootModel
from pydantic.json_schema import models_json_schema

import lmserve
from lmserve.server import protocol as p
from lmserve.server.api import ollama_protocol as ol
from lmserve.server.api.anthropic_protocol import CountTokensRequest, MessagesRequest
from lmserve.server.api.embeddings import EmbeddingRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest
from lmserve.server.api.kserve import V2InferRequest
from lmserve.server.api.responses_input import ResponsesRequest
from lmserve.server.api.retrieval_protocol import ClassifyRequest, RerankRequest, ScoreRequest, TEIEmbedRequest
from lmserve.server.errors import TEI_PATHS, is_anthropic, is_ollama, is_tgi, is_v2
from lmserve.server.playground.routes import SHARES, ShareRequest

JSON, SSE, TEXT, HTML, NDJSON = "application/json", "text/event-stream", "text/plain", "text/html", "application/x-ndjson"
CSS, JS = "text/css", "text/javascript"
MULTIPART, OCTETS = "multipart/form-data", "application/octet-stream"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class OpenAIErrorDetail(_Open):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(_Open):
    """The error body of every non-TGI route."""

    error: OpenAIErrorDetail


class TGIError(_Open):
    """The error body of the TGI routes (/, /generate, /generate_stream, /info)."""

    error: str
    error_type: str


class AnthropicErrorDetail(_Open):
    type: str
    message: str


class AnthropicError(_Open):
    """The error body of the Anthropic Messages routes (/v1/messages, /v1/messages/count_tokens)."""

    type: str
    error: AnthropicErrorDetail


class AnthropicUsage(_Open):
    input_tokens: int  # the prompt tokens not read from the prefix cache
    output_tokens: int
    cache_read_input_tokens: int | None = None  # the prompt tokens read from the prefix cache
    cache_creation_input_tokens: int | None = None  # always 0: caching is automatic and costs nothing extra


class AnthropicMessage(_Open):
    id: str
    type: str
    role: str
    model: str
    content: list[dict[str, Any]]  # thinking (with --reasoning-parser), text and tool_use blocks
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(_Open):
    input_tokens: int


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # cached_tokens: prompt tokens from the prefix cache


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class Completion(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(_Open):
    role: str
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class ChatCompletion(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ResponseObject(_Open):
    """OpenAI's Response object (POST /v1/responses, GET /v1/responses/{id}); streamed as typed events."""

    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    error: dict[str, Any] | None


class ResponseDeleted(_Open):
    id: str
    object: str
    deleted: bool


class InputItemList(_Open):
    object: str
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ModelCard(_Open):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int | None
    parent: str | None = None  # a LoRA adapter's base model; None for the base itself
    root: str | None = None
    weight_format: str | None = None  # a loaded model: gguf | int8 | int4 | none (--quantization, auto resolved)


class ModelList(_Open):
    object: str
    data: list[ModelCard]


class LoraLoaded(_Open):
    object: str
    id: str
    parent: str
    loaded: bool


class LoraUnloaded(_Open):
    object: str
    id: str
    deleted: bool


class TGIGenerated(_Open):
    generated_text: str
    details: dict[str, Any] | None = None


class TGIInfo(_Open):
    model_id: str
    max_best_of: int
    max_stop_sequences: int
    router: str
    version: str


class V2Error(_Open):
    """The error body of the KServe v2 routes (/v2/...)."""

    error: str


class OllamaError(_Open):
    """The error body of the Ollama routes (/api/...), also a stream's in-band error line."""

    error: str


class OllamaMessage(_Open):
    role: str
    content: str
    thinking: str | None = None  # with --reasoning-parser, unless think is false
    tool_calls: list[dict[str, Any]] | None = None  # each {"function": {"name", "arguments": {...}}}


class _OllamaFinal(_Open):
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


class OllamaDetails(_Open):
    format: str
    family: str
    parameter_size: str
    quantization_level: str


class OllamaModel(_Open):
    name: str
    model: str
    size: int
    digest: str
    modified_at: str
    details: OllamaDetails


class OllamaTags(_Open):
    models: list[OllamaModel]


class OllamaLoadedModel(OllamaModel):
    expires_at: str
    size_vram: int
    context_length: int


class OllamaPs(_Open):
    models: list[OllamaLoadedModel]


class OllamaShow(_Open):
    details: OllamaDetails
    model_info: dict[str, Any]
    template: str
    capabilities: list[str]


class EmbeddingUsage(_Open):
    prompt_tokens: int
    total_tokens: int


class Embedding(_Open):
    object: str
    index: int
    embedding: list[float] | str  # str: encoding_format base64 (little-endian float32)


class EmbeddingList(_Open):
    object: str
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


class OllamaEmbedded(_Open):
    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbedding(_Open):
    embedding: list[float]


class RerankResult(_Open):
    index: int
    relevance_score: float


class RerankAnswer(_Open):
    """Jina / Cohere: results best first."""

    model: str
    results: list[RerankResult]


class TEIRank(_Open):
    index: int
    score: float


class RerankAnswers(RootModel[RerankAnswer | list[TEIRank]]):
    """/rerank answers Jina's shape, or TEI's list where the body was TEI's (`texts`)."""


class ScoreItem(_Open):
    index: int
    score: float


class ScoreAnswer(_Open):
    object: str
    model: str
    data: list[ScoreItem]


class ClassifyItem(_Open):
    index: int
    label: str
    probs: list[float]


class ClassifyAnswer(_Open):
    object: str
    model: str
    data: list[ClassifyItem]


class TEIEmbeddings(RootModel[list[list[float]]]):
    """TEI's /embed: one vector per input."""


class V2Live(_Open):
    live: bool


class V2Ready(_Open):
    ready: bool


class V2ModelReady(_Open):
    name: str
    ready: bool


class V2TensorMetadata(_Open):
    name: str
    datatype: str
    shape: list[int]


class V2ModelMetadata(_Open):
    name: str
    versions: list[str]
    platform: str
    inputs: list[V2TensorMetadata]
    outputs: list[V2TensorMetadata]


class V2OutputTensor(_Open):
    name: str
    datatype: str
    shape: list[int]
    data: list[str]


class V2InferResponse(_Open):
    model_name: str
    id: str
    outputs: list[V2OutputTensor]


class Health(_Open):
    status: str = Field(description="ok (200); loading, draining, dead or failed (503)")
    error: dict | None = Field(default=None, description="while loading or after a failed load: llama.cpp's "
                               "{code, message, type} object")


class Version(_Open):
    version: str


class Tokenized(_Open):
    tokens: list[int]
    count: int | None = None  # absent when the request gave llama.cpp's `content`
    max_model_len: int | None = None


class Detokenized(_Open):
    prompt: str
    content: str  # the same text, under llama.cpp's name


class DriftReport(_Open):
    """Per-feature drift statistics (see ops/drift.py)."""


class ShareInfo(_Open):
    """A saved playground share: its permalink is `url` (/p/<id>)."""

    id: str
    object: str
    url: str
    title: str
    mode: str
    created: int


class ShareList(_Open):
    object: str
    data: list[ShareInfo]


class SharedState(ShareInfo):
    """A share with everything it saved: what the permalink's page shows again."""

    model: str
    system: str
    prompt: str
    params: dict[str, Any]
    output: dict[str, Any]


class ShareDeleted(_Open):
    id: str
    object: str
    deleted: bool


class FileUpload(BaseModel):
    """POST /v1/files, as multipart/form-data: the file's bytes and its purpose."""

    file: bytes = Field(json_schema_extra={"format": "binary", "type": "string"})
    purpose: Literal["batch"]


class FileObject(_Open):
    id: str
    object: str
    bytes: int
    created_at: int
    filename: str
    purpose: str


class FileDeleted(_Open):
    id: str
    object: str
    deleted: bool


class BatchRequestCounts(_Open):
    total: int
    completed: int
    failed: int


class BatchObject(_Open):
    id: str
    object: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    output_file_id: str | None
    error_file_id: str | None
    request_counts: BatchRequestCounts


class BatchList(_Open):
    object: str
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


@dataclass(frozen=True)
class RouteDoc:
    """What one operation takes (`body`) and answers with 200 (`answer`, in `media`), and its error statuses."""

    body: type[BaseModel] | None
    answer: type[BaseModel] | None
    errors: tuple[int, ...]
    media: tuple[str, ...] = (JSON,)
    body_media: str = JSON


# 401 on every route but /health (API keys); 413 wherever a body is read; 429 per-key limits; 503 not ready.
_GEN = (400, 401, 404, 413, 429, 500, 503)
_OLLAMA_GEN = (400, 401, 403, 404, 413, 429, 500, 503)
_TGI = (401, 404, 413, 422, 429, 500, 503)  # 404: an unknown parameters.adapter_id
ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("get", "/v1/models"): RouteDoc(None, ModelList, (401,)),
    ("post", "/v1/completions"): RouteDoc(p.CompletionRequest, Completion, _GEN, (JSON, SSE)),
    ("post", "/v1/chat/completions"): RouteDoc(p.ChatRequest, ChatCompletion, _GEN, (JSON, SSE)),
    ("post", "/v1/messages"): RouteDoc(MessagesRequest, AnthropicMessage, _GEN, (JSON, SSE)),
    ("post", "/v1/messages/count_tokens"): RouteDoc(CountTokensRequest, TokenCount, (400, 401, 404, 413, 503)),
    # The Responses API (server/api/responses.py): 404 also for another key's response id.
    ("post", "/v1/responses"): RouteDoc(ResponsesRequest, ResponseObject, _GEN, (JSON, SSE)),
    ("get", "/v1/responses/{response_id}"): RouteDoc(None, ResponseObject, (401, 404)),
    ("delete", "/v1/responses/{response_id}"): RouteDoc(None, ResponseDeleted, (401, 404)),
    ("get", "/v1/responses/{response_id}/input_items"): RouteDoc(None, InputItemList, (400, 401, 404)),
    ("post", "/generate"): RouteDoc(p.TGIRequest, TGIGenerated, _TGI),
    ("post", "/generate_stream"): RouteDoc(p.TGIRequest, None, _TGI, (SSE,)),
    ("post", "/"): RouteDoc(p.TGICompatRequest, TGIGenerated, _TGI, (JSON, SSE)),
    ("get", "/info"): RouteDoc(None, TGIInfo, (401,)),
    ("get", "/health"): RouteDoc(None, Health, (503,)),
    ("get", "/version"): RouteDoc(None, Version, (401,)),
    ("get", "/metrics"): RouteDoc(None, None, (401, 403), (TEXT,)),  # 403: any key but an admin's
    ("get", "/v1/monitoring/drift"): RouteDoc(None, DriftReport, (401, 404)),
    ("post", "/v1/embeddings"): RouteDoc(EmbeddingRequest, EmbeddingList, _GEN),
    ("post", "/api/embed"): RouteDoc(OllamaEmbedRequest, OllamaEmbedded, _GEN),
    ("post", "/api/embeddings"): RouteDoc(OllamaEmbeddingsRequest, OllamaEmbedding, _GEN),
    # retrieval (server/api/retrieval.py): rerank, score, classify, TEI's embed
    ("post", "/v1/rerank"): RouteDoc(RerankRequest, RerankAnswer, _GEN),
    ("post", "/rerank"): RouteDoc(RerankRequest, RerankAnswers, _GEN),
    ("post", "/v1/score"): RouteDoc(ScoreRequest, ScoreAnswer, _GEN),
    ("post", "/classify"): RouteDoc(ClassifyRequest, ClassifyAnswer, _GEN),
    ("post", "/embed"): RouteDoc(TEIEmbedRequest, TEIEmbeddings, _GEN),
    ("post", "/tokenize"): RouteDoc(p.TokenizeRequest, Tokenized, (400, 401, 404, 413, 503)),
    ("post", "/detokenize"): RouteDoc(p.DetokenizeRequest, Detokenized, (400, 401, 404, 413, 503)),
    # The playground: its page and files need no key (404: the playground is off); its data routes do.
    ("get", "/"): RouteDoc(None, None, (404,), (HTML,)),
    ("get", "/playground"): RouteDoc(None, None, (404,), (HTML,)),
    # An id or name that cannot be one (wrong characters or length) is not a page: it needs the key.
    ("get", "/p/{share_id}"): RouteDoc(None, None, (401, 404), (HTML,)),
    ("get", "/playground/assets/{name}"): RouteDoc(None, None, (401, 404), (JS, CSS)),
    ("post", SHARES): RouteDoc(ShareRequest, ShareInfo, (400, 401, 404, 413, 503)),
    ("get", SHARES): RouteDoc(None, ShareList, (401, 404, 503)),
    ("get", SHARES + "/{share_id}"): RouteDoc(None, SharedState, (401, 404, 503)),
    ("delete", SHARES + "/{share_id}"): RouteDoc(None, ShareDeleted, (401, 404, 503)),
    # Batch jobs (server/batch/routes.py): 404 for an unknown id, another key's object, or batch jobs off.
    ("get", "/v2/health/live"): RouteDoc(None, V2Live, ()),
    ("get", "/v2/health/ready"): RouteDoc(None, V2Ready, (503,)),
    ("get", "/v2/models/{name}"): RouteDoc(None, V2ModelMetadata, (401, 404)),
    ("get", "/v2/models/{name}/ready"): RouteDoc(None, V2ModelReady, (401, 404, 503)),
    ("post", "/v2/models/{name}/infer"): RouteDoc(V2InferRequest, V2InferResponse, (400, 401, 404, 413, 429, 500, 503)),
    ("post", "/v1/files"): RouteDoc(FileUpload, FileObject, (400, 401, 404, 413), body_media=MULTIPART),
    ("get", "/v1/files/{file_id}"): RouteDoc(None, FileObject, (401, 404)),
    ("delete", "/v1/files/{file_id}"): RouteDoc(None, FileDeleted, (401, 404)),
    ("get", "/v1/files/{file_id}/content"): RouteDoc(None, None, (401, 404), (OCTETS,)),
    ("post", "/v1/batches"): RouteDoc(p.BatchCreateRequest, BatchObject, (400, 401, 404, 413)),
    ("get", "/v1/batches"): RouteDoc(None, BatchList, (400, 401, 404)),
    ("get", "/v1/batches/{batch_id}"): RouteDoc(None, BatchObject, (401, 404)),
    ("post", "/v1/batches/{batch_id}/cancel"): RouteDoc(None, BatchObject, (401, 404, 413)),
    # Dynamic LoRA (server/api/lora.py): 404 when --allow-runtime-lora-updating is off or the name is unknown;
    # 403 a name outside the key's namespace or models, a directory outside its lora_dirs, or another key's
    # adapter; 409 a name already loaded.
    ("post", "/v1/load_lora_adapter"): RouteDoc(p.LoadLoraAdapterRequest, LoraLoaded,
                                                (400, 401, 403, 404, 409, 413, 503)),
    ("post", "/v1/unload_lora_adapter"): RouteDoc(p.UnloadLoraAdapterRequest, LoraUnloaded,
                                                  (400, 401, 403, 404, 413, 503)),
    # Ollama (server/api/ollama.py): NDJSON unless "stream": false; errors {"error": message}. HEAD / is Ollama's
    # liveness check (GET / stays the playground's page). 403: a keep_alive of 0 from a key that may not unload.
    ("post", "/api/chat"): RouteDoc(ol.ChatRequest, OllamaChatResponse, _OLLAMA_GEN, (JSON, NDJSON)),
    ("post", "/api/generate"): RouteDoc(ol.GenerateRequest, OllamaGenerateResponse, _OLLAMA_GEN, (JSON, NDJSON)),
    ("post", "/api/show"): RouteDoc(ol.ShowRequest, OllamaShow, (400, 401, 404, 413, 503)),
    ("get", "/api/tags"): RouteDoc(None, OllamaTags, (401,)),
    ("get", "/api/ps"): RouteDoc(None, OllamaPs, (401,)),
    ("get", "/api/version"): RouteDoc(None, Version, (401,)),
    ("head", "/"): RouteDoc(None, None, (401,), (TEXT,)),  # Ollama's "Ollama is running" (no body: HEAD)
}
_ERROR_MODELS = (OpenAIError, TGIError, V2Error, AnthropicError, OllamaError)


def build_document(endpoints: list[tuple[str, tuple[str, ...], Any]]) -> dict:
    """FastAPI's document of the app's endpoints ((path, methods, endpoint) as server/router.py keeps them: their
    path and query parameters), with each RouteDoc's body, answer and error bodies filled in."""
    routes = [APIRoute(path, endpoint, methods=list(methods), response_model=None)
              for path, methods, endpoint in endpoints]
    doc = get_openapi(title="lmserve", version=lmserve.__version__, routes=routes)
    schemas = _component_schemas()
    doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
    for (method, path), route in ROUTES.items():
        op = doc["paths"].get(path, {}).get(method)
        if op is not None:
            _fill(op, path, route)
    return doc


def _component_schemas() -> dict[str, Any]:
    """JSON schemas of every body and answer model, referenced as #/components/schemas/<Name>."""
    models = {m for r in ROUTES.values() for m in (r.body, r.answer) if m is not None} | set(_ERROR_MODELS)
    bodies = {r.body for r in ROUTES.values() if r.body is not None}
    pairs = [(m, "validation" if m in bodies else "serialization") for m in sorted(models, key=lambda m: m.__name__)]
    top, defs = models_json_schema(pairs, ref_template="#/components/schemas/{model}")
    return defs.get("$defs", {})


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _fill(op: dict, path: str, route: RouteDoc) -> None:
    if route.body is not None:
        op["requestBody"] = {"required": True, "content": {route.body_media: {"schema": _ref(route.body)}}}
    op["responses"] = {"200": {"description": "OK", "content": {m: {"schema": _answer_schema(m, route)}
                                                                  for m in route.media}}}
    error = _ref(TGIError if is_tgi(path) or path in TEI_PATHS else V2Error if is_v2(path) else AnthropicError if is_anthropic(path)
                 else OllamaError if is_ollama(path)
                 else OpenAIError)
    for status in route.errors:
        schema = _ref(Health) if path == "/health" else error
        op["responses"][str(status)] = {"description": _REASONS[status], "content": {JSON: {"schema": schema}}}


# One server-sent event (what OpenAPI 3.2's itemSchema describes; schemathesis checks each event against it):
# `data` holds one JSON chunk, an error object, or [DONE].
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
              "required": ["data"]}


def _answer_schema(media: str, route: RouteDoc) -> dict:
    if media == JSON and route.answer is not None:
        return _ref(route.answer)
    return _SSE_EVENT if media == SSE else {"type": "string"}  # Prometheus text, the playground's files


_REASONS = {400: "Invalid request", 401: "Missing or invalid API key",
            403: "The key may not do this (another key's adapter, a name outside its models, not an admin key)",
            404: "Unknown model or id (or feature off)", 409: "The name is taken (unload it first)",
            413: "Request body too large", 422: "Invalid request (TGI)", 429: "Rate limit of the API key",
            500: "The engine failed while running the request", 503: "Loading, draining, at capacity, stopped, or a store unavailable"}
