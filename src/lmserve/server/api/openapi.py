"""The served OpenAPI document: every route with its request body, its answer and its error bodies.

Routes read their bodies themselves (strict parsing in protocol.parse_body) and answer plain dicts, so
FastAPI sees neither; this module adds both to the generated document, once, on the first
/openapi.json (server/app.py imports it only then: building its models is no part of a start). The
response models describe what the routes answer (extra fields allowed: the document promises
fields, not their absence); a fuzzer checks every answer against them. Each dialect's rows and models are in its
`<dialect>/openapi.py` (server/api/dialects.py lists them); this module has the rest's and builds the document.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

import lmserve
from lmserve.server import protocol as p
from lmserve.server.api.dialects import DIALECTS, dialect_of_errors
from lmserve.server.api.route_doc import CSS, HTML, JS, JSON, MULTIPART, OCTETS, SSE, TEXT, Open, RouteDoc, Version
from lmserve.server.playground.routes import SHARES, ShareRequest


class OpenAIErrorDetail(Open):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(Open):
    """The error body of every non-TGI route."""

    error: OpenAIErrorDetail


class Health(Open):
    status: str = Field(description="ok (200); loading, draining, dead or failed (503)")
    error: dict | None = Field(default=None, description="while loading or after a failed load: llama.cpp's "
                               "{code, message, type} object")


class Tokenized(Open):
    tokens: list[int]
    count: int | None = None  # absent when the request gave llama.cpp's `content`
    max_model_len: int | None = None


class Detokenized(Open):
    prompt: str
    content: str  # the same text, under llama.cpp's name


class DriftReport(Open):
    """Per-feature drift statistics (see ops/drift.py)."""


class ShareInfo(Open):
    """A saved playground share: its permalink is `url` (/p/<id>)."""

    id: str
    object: str
    url: str
    title: str
    mode: str
    created: int


class ShareList(Open):
    object: str
    data: list[ShareInfo]


class SharedState(ShareInfo):
    """A share with everything it saved: what the permalink's page shows again."""

    model: str
    system: str
    prompt: str
    params: dict[str, Any]
    output: dict[str, Any]


class ShareDeleted(Open):
    id: str
    object: str
    deleted: bool


class FileUpload(BaseModel):
    """POST /v1/files, as multipart/form-data: the file's bytes and its purpose."""

    file: bytes = Field(json_schema_extra={"format": "binary", "type": "string"})
    purpose: Literal["batch"]


class FileObject(Open):
    id: str
    object: str
    bytes: int
    created_at: int
    filename: str
    purpose: str


class FileDeleted(Open):
    id: str
    object: str
    deleted: bool


class BatchRequestCounts(Open):
    total: int
    completed: int
    failed: int


class BatchObject(Open):
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


class BatchList(Open):
    object: str
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


_OWN_ROUTES: dict[tuple[str, str], RouteDoc] = {  # the misc, playground and batch routes
    ("get", "/health"): RouteDoc(None, Health, (503,)),
    ("get", "/version"): RouteDoc(None, Version, (401,)),
    ("get", "/metrics"): RouteDoc(None, None, (401, 403), (TEXT,)),  # 403: any key but an admin's
    ("get", "/v1/monitoring/drift"): RouteDoc(None, DriftReport, (401, 404)),
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
    ("post", "/v1/files"): RouteDoc(FileUpload, FileObject, (400, 401, 404, 413), body_media=MULTIPART),
    ("get", "/v1/files/{file_id}"): RouteDoc(None, FileObject, (401, 404)),
    ("delete", "/v1/files/{file_id}"): RouteDoc(None, FileDeleted, (401, 404)),
    ("get", "/v1/files/{file_id}/content"): RouteDoc(None, None, (401, 404), (OCTETS,)),
    ("post", "/v1/batches"): RouteDoc(p.BatchCreateRequest, BatchObject, (400, 401, 404, 413)),
    ("get", "/v1/batches"): RouteDoc(None, BatchList, (400, 401, 404)),
    ("get", "/v1/batches/{batch_id}"): RouteDoc(None, BatchObject, (401, 404)),
    ("post", "/v1/batches/{batch_id}/cancel"): RouteDoc(None, BatchObject, (401, 404, 413)),
}
ROUTES: dict[tuple[str, str], RouteDoc] = {**_OWN_ROUTES, **{k: v for d in DIALECTS for k, v in d.openapi.ROUTES.items()}}
_ERROR_MODELS = (OpenAIError, *(d.openapi.ERROR_MODEL for d in DIALECTS if d.openapi.ERROR_MODEL is not None))


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
    dialect = dialect_of_errors(path)
    error = _ref(OpenAIError if dialect is None else dialect.openapi.ERROR_MODEL)
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
