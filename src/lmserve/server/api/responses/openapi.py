"""The OpenAPI rows of the Responses API's routes (404 also for another key's response id), and the models of
their answers."""

from __future__ import annotations

from typing import Any

from lmserve.server.api.responses.input import ResponsesRequest
from lmserve.server.api.route_doc import GEN_ERRORS, JSON, SSE, Open, RouteDoc


class ResponseObject(Open):
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


class ResponseDeleted(Open):
    id: str
    object: str
    deleted: bool


class InputItemList(Open):
    object: str
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("post", "/v1/responses"): RouteDoc(ResponsesRequest, ResponseObject, GEN_ERRORS, (JSON, SSE)),
    ("get", "/v1/responses/{response_id}"): RouteDoc(None, ResponseObject, (401, 404)),
    ("delete", "/v1/responses/{response_id}"): RouteDoc(None, ResponseDeleted, (401, 404)),
    ("get", "/v1/responses/{response_id}/input_items"): RouteDoc(None, InputItemList, (400, 401, 404)),
}
ERROR_MODEL = None
