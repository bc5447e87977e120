"""vLLM's dynamic LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Off unless the server runs with --allow-runtime-lora-updating (404 then), behind the API key like every
route; who may load and unload what is server/adapter_owners.py. A path is read only when it resolves
(symlinks followed, `..` collapsed) inside one of the --lora-dir directories (else a 400 that names paths
relative to the --lora-dir) and inside a subdirectory the key's `lora_dirs` allows (else a 403), and every
file read from it must resolve inside that subdirectory too (lora/peft_adapter.py). Reading happens on a
worker thread: the event loop and the engine keep serving while an adapter loads. Each route holds the model
(a lease, loading it if it was unloaded), so it cannot unload while an adapter is being registered.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from starlette.requests import Request

from lmserve.lora.peft_adapter import AdapterError
from lmserve.lora.registry import AdapterNameTaken
from lmserve.server.adapter_owners import allowed_root, taken
from lmserve.server.errors import APIError, excerpt
from lmserve.server.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest, parse_body
from lmserve.server.router import Router
from lmserve.server.served import ModelState
from lmserve.server.state import LEASES_KEY, ServerState, key_name_of, state_of

router = Router()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> dict:
    """Read, check and register an adapter, owned by the key that loads it; usable as `model` once this answers."""
    st, key = _updating(request), key_name_of(request)
    req = parse_body(await request.body(), LoadLoraAdapterRequest)
    if req.lora_name in st.model_names():
        raise APIError(400, f"lora_name {excerpt(req.lora_name)} is a served model's name", param="lora_name")
    ms = await _bound(request, st)
    loras = ms.front.loras
    st.adapter_owners.check_load(st.tenants, key, req.lora_name, loras)
    path, root = confined_path(req.lora_path, st.config.lora_dirs)
    root = _key_root(st, key, req.lora_path, path, root)
    try:
        lora = await asyncio.to_thread(loras.register, req.lora_name, path, root)
    except AdapterNameTaken:  # loaded by another request while this one read
        raise taken(req.lora_name) from None
    except AdapterError as e:
        raise APIError(400, str(e), param="lora_path") from None
    reg = loras.lookup(lora.name)
    if reg is not None and reg.lora_int_id == lora.lora_int_id:
        st.adapter_owners.loaded(key, reg)
    return {"object": "model", "id": lora.name, "parent": st.config.served_model_name, "loaded": True}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> dict:
    """Forget an adapter: new requests naming it get 404; requests already using it finish with it."""
    st, key = _updating(request), key_name_of(request)
    req = parse_body(await request.body(), UnloadLoraAdapterRequest)
    loras = (await _bound(request, st)).front.loras
    reg = st.adapter_owners.check_unload(st.tenants, key, req.lora_name, loras)
    loras.unregister(reg.name)
    st.adapter_owners.unloaded(reg)
    return {"object": "model", "id": req.lora_name, "deleted": True}


def _updating(request: Request) -> ServerState:
    st = state_of(request)
    if not st.config.allow_runtime_lora_updating:
        raise APIError(404, "runtime LoRA updating is off (start the server with --allow-runtime-lora-updating)")
    st.check_ready()
    return st


async def _bound(request: Request, st: ServerState) -> ModelState:
    """The default model, held until the response ends and loaded first if it was unloaded (its kept adapters
    are registered again as it loads: server/adapter_owners.py)."""
    return await st.bind(st.models.default, request.scope.setdefault("state", {}).setdefault(LEASES_KEY, []))


def _key_root(st: ServerState, key: str, asked: str, path: Path, root: Path) -> Path:
    """The subdirectory of `root` the key may load `path` from (its files must stay inside it); else 403."""
    allowed = st.tenants.lora_dirs(key)
    inside = allowed_root(path, root, allowed)
    if inside is None:
        raise APIError(403, f"lora_path {excerpt(asked)} is not in a --lora-dir subdirectory this key may load "
                       f"from ({', '.join(allowed) or 'none'}: its key entry's lora_dirs)", param="lora_path",
                       code="permission_denied")
    return inside


def confined_path(path: str, roots: tuple[str, ...]) -> tuple[Path, Path]:
    """(`path` resolved (symlinks, `..`), the root it lies inside) for one of `roots` (already resolved); else 400."""
    try:
        resolved = Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        resolved = None
    if resolved is not None:
        for root in roots:
            if resolved.is_relative_to(root) and resolved != Path(root):
                return resolved, Path(root)
    raise APIError(400, f"lora_path {excerpt(path)} is not inside a --lora-dir directory", param="lora_path")
