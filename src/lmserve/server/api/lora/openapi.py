"""The OpenAPI rows of the dynamic LoRA routes, and the models of their answers: 404 when
--allow-runtime-lora-updating is off or the name is unknown; 403 a name outside the key's namespace or models, a
directory outside its lora_dirs, or another key's adapter; 409 a name already loaded."""

from __future__ import annotations

from lmserve.server import protocol as p
from lmserve.server.api.route_doc import Open, RouteDoc


class LoraLoaded(Open):
    object: str
    id: str
    parent: str
    loaded: bool


class LoraUnloaded(Open):
    object: str
    id: str
    deleted: bool


ROUTES: dict[tuple[str, str], RouteDoc] = {
    ("post", "/v1/load_lora_adapter"): RouteDoc(p.LoadLoraAdapterRequest, LoraLoaded,
                                                (400, 401, 403, 404, 409, 413, 503)),
    ("post", "/v1/unload_lora_adapter"): RouteDoc(p.UnloadLoraAdapterRequest, LoraUnloaded,
                                                  (400, 401, 403, 404, 413, 503)),
}
ERROR_MODEL = None
