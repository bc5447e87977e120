"""vLLM's dynamic LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Off unless the server runs with --allow-runtime-lora-updating (404 then), behind the API key like every
route. A path is read only when it resolves (symlinks followed, `..` collapsed) inside one of the
--lora-dir directories; anything else is a 400 before the disk is touched. Reading happens on a worker
thread: the event loop and the engine keep serving while an adapter loads.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter
from starlette.requests import Request

from lmserve.lora.peft_adapter import AdapterError
from lmserve.server.errors import APIError, excerpt
from lmserve.server.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest, parse_body
from lmserve.server.state import ServerState, state_of

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> dict:
    """Read, check and register an adapter; it is usable as `model` once this answers."""
    st = _updating(request)
    req = parse_body(await request.body(), LoadLoraAdapterRequest)
    if req.lora_name == st.config.served_model_name:
        raise APIError(400, f"lora_name {excerpt(req.lora_name)} is the base model's name", param="lora_name")
    path = confined_path(req.lora_path, st.config.lora_dirs)
    try:
        lora = await asyncio.to_thread(st.front.loras.register, req.lora_name, path)
    except AdapterError as e:
        raise APIError(400, str(e), param="lora_path") from None
    return {"object": "model", "id": lora.name, "parent": st.config.served_model_name, "loaded": True}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> dict:
    """Forget an adapter: new requests naming it get 404; requests already using it finish with it."""
    st = _updating(request)
    req = parse_body(await request.body(), UnloadLoraAdapterRequest)
    if not st.front.loras.unregister(req.lora_name):
        raise APIError(404, f"no LoRA adapter named {excerpt(req.lora_name)} is loaded", param="lora_name",
                       code="model_not_found")
    return {"object": "model", "id": req.lora_name, "deleted": True}


def _updating(request: Request) -> ServerState:
    st = state_of(request)
    if not st.config.allow_runtime_lora_updating:
        raise APIError(404, "runtime LoRA updating is off (start the server with --allow-runtime-lora-updating)")
    st.check_ready()
    return st


def confined_path(path: str, roots: tuple[str, ...]) -> Path:
    """`path` resolved (symlinks, `..`) if it lies inside one of `roots` (already resolved); else a 400."""
    try:
        resolved = Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        resolved = None
    if resolved is not None:
        for root in roots:
            if resolved.is_relative_to(root) and resolved != Path(root):
                return resolved
    raise APIError(400, f"lora_path {excerpt(path)} is not inside a --lora-dir directory", param="lora_path")
