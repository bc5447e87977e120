"""The OpenAPI rows of TGI's routes, and the models of their answers."""

from __future__ import annotations

from typing import Any

from lmserve.server.api.route_doc import JSON, SSE, Open, RouteDoc, TGIError
from lmserve.server.api.tgi.protocol import TGICompatRequest, TGIParameters, TGIRequest

TGI_ERRORS = (401, 404, 413, 422, 429, 500, 503)  # 404: an unknown parameters.adapter_id


class TGIGenerated(Open):
    generated_text: str
    details: dict[str, Any] | None = None


class TGIInfo(Open):
    model_id: str
    max_best_of: int
    max_stop_sequences: int
    router: str
    version: str


ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("post", "/generate"): RouteDoc(TGIRequest, TGIGenerated, TGI_ERRORS),
    ("post", "/generate_stream"): RouteDoc(TGIRequest, None, TGI_ERRORS, (SSE,)),
    ("get", "/info"): RouteDoc(None, TGIInfo, (401,)),
    ("post", "/"): RouteDoc(TGICompatRequest, TGIGenerated, TGI_ERRORS, (JSON, SSE)),
}
ERROR_MODEL = TGIError
# the bodies whose fields a validation rule may name (server/main.py rule_params)
RULE_MODELS = (TGIRequest, TGIParameters, TGICompatRequest)
