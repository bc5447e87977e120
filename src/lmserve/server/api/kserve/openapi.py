"""The OpenAPI rows of KServe v2's routes, and the models of their answers."""

from __future__ import annotations

from lmserve.server.api.kserve.routes import V2InferRequest
from lmserve.server.api.route_doc import Open, RouteDoc


class V2Error(Open):
    """The error body of the KServe v2 routes (/v2/...)."""

    error: str


class V2Live(Open):
    live: bool


class V2Ready(Open):
    ready: bool


class V2ModelReady(Open):
    name: str
    ready: bool


class V2TensorMetadata(Open):
    name: str
    datatype: str
    shape: list[int]


class V2ModelMetadata(Open):
    name: str
    versions: list[str]
    platform: str
    inputs: list[V2TensorMetadata]
    outputs: list[V2TensorMetadata]


class V2OutputTensor(Open):
    name: str
    datatype: str
    shape: list[int]
    data: list[str]


class V2InferResponse(Open):
    model_name: str
    id: str
    outputs: list[V2OutputTensor]


ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("get", "/v2/health/live"): RouteDoc(None, V2Live, ()),
    ("get", "/v2/health/ready"): RouteDoc(None, V2Ready, (503,)),
    ("get", "/v2/models/{name}"): RouteDoc(None, V2ModelMetadata, (401, 404)),
    ("get", "/v2/models/{name}/ready"): RouteDoc(None, V2ModelReady, (401, 404, 503)),
    ("post", "/v2/models/{name}/infer"): RouteDoc(V2InferRequest, V2InferResponse, (400, 401, 404, 413, 429, 500, 503)),
}
ERROR_MODEL = V2Error
