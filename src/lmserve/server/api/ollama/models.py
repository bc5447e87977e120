"""The Ollama API's model routes: /api/tags (the served models), /api/show (one model's card, without loading it)
and /api/ps (the loaded ones, with when each unloads if it stays idle).

Sizes and dates are the weight files' (read off the event loop); the digest is a hash of the model's name, size
and modification time, so it changes when the files do; `parameter_size` is counted from the decoder's shape.
No body names a server path (the Modelfile's FROM is the served name): a key learns what it may use, not
where the operator keeps it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from starlette.requests import Request

from lmserve.server.api.ollama.protocol import LATEST, ShowRequest
from lmserve.server.api.tools import template_variables
from lmserve.server.errors import APIError
from lmserve.server.protocol import parse_body
from lmserve.server.router import Router
from lmserve.server.state import key_name_of, state_of

router = Router()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")

_FOREVER = timedelta(microseconds=2**63 // 1000)  # Ollama's expiry for a model kept loaded (a max Go duration)


@router.get("/api/tags")
async def tags(request: Request) -> dict:
    """Every served model the key may use, loaded or not."""
    st = state_of(request)
    key = key_name_of(request)
    models = [m for name, m in st.models.models.items() if st.tenants.allows(key, name)]
    return {"models": [await asyncio.to_thread(_card, m) for m in models]}


@router.post("/api/show")
async def show(request: Request) -> dict:
    """One model's details, its architecture's numbers (`model_info`), chat template and capabilities; an
    unloaded model stays unloaded."""
    st = state_of(request)
    st.check_ready()
    req = parse_body(await request.body(), ShowRequest, st.config.strict_fields)
    name = (req.model or req.name or "").removesuffix(LATEST)
    if not name:
        raise APIError(400, "model is required", param="model")
    st.tenants.check_model(key_name_of(request), name)
    model = st.models.get(name)
    if model is None:
        raise APIError(404, f"model {name[:80]!r} not found", param="model")
    card = await asyncio.to_thread(_card, model)
    engine = model.async_engine
    template = engine.front.tokenizer.chat_template if engine is not None else None
    config = engine.front.loaded.config if engine is not None else model.spec.model_config
    context = engine.front.max_model_len if engine is not None else model.spec.max_model_len
    capabilities = ["completion", "tools"] + (["thinking"] if "enable_thinking" in template_variables(template) else [])
    return {"modified_at": card["modified_at"], "details": card["details"], "template": template or "",
            "modelfile": f"# served by lmserve\nFROM {model.name}\n", "parameters": "", "license": "",
            "model_info": _model_info(config, context), "capabilities": capabilities}


@router.get("/api/ps")
async def ps(request: Request) -> dict:
    """The loaded models, with when each unloads if it stays idle (`expires_at`); one being unloaded is listed
    until its memory is given back (as Ollama lists a runner until it has stopped)."""
    st = state_of(request)
    key = key_name_of(request)
    out = []
    for m in st.models.models.values():
        engine = m.async_engine  # now: an unload may detach it while the card is read
        if not (engine is not None or m.unloading) or not st.tenants.allows(key, m.name):
            continue
        card = await asyncio.to_thread(_card, m)
        on_gpu = engine is not None and engine.front.device.type == "cuda"
        context = engine.front.max_model_len if engine is not None else m.spec.max_model_len
        out.append({**card, "expires_at": _expires_at(m), "size_vram": card["size"] if on_gpu else 0,
                    "context_length": context})
    return {"models": out}


def _expires_at(model) -> str:
    if model.unloading:
        return _now()
    if model.keep_alive is None:
        at = datetime.now(timezone.utc) + _FOREVER
    else:
        idle = 0.0 if model.idle_since is None else time.monotonic() - model.idle_since  # in use: from now
        at = datetime.now(timezone.utc) + timedelta(seconds=model.keep_alive - idle)
    return at.isoformat().replace("+00:00", "Z")


def _path(model) -> Path | None:
    config = model.spec.config
    return Path(config.model) if config is not None and config.model else None


def _card(model) -> dict:
    """A model as /api/tags lists it (read from its files: off the event loop)."""
    path = _path(model)
    files = ([path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]) if path else []
    stats = [p.stat() for p in files]
    size = sum(s.st_size for s in stats)
    mtime = max((s.st_mtime for s in stats), default=time.time())
    digest = hashlib.sha256(f"{model.name}\0{size}\0{mtime}".encode()).hexdigest()  # changes when the files do
    return {"name": model.name, "model": model.name, "size": size, "digest": digest,
            "modified_at": datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z"),
            "details": _details(model, path)}


def _details(model, path: Path | None) -> dict:
    engine = model.async_engine
    config = engine.front.loaded.config if engine is not None else model.spec.model_config
    family = config.architecture.lower().removesuffix("forcausallm") if config is not None else ""
    quant = engine.front.loaded.quantization.removeprefix("MOSTLY_") if engine is not None else ""
    fmt = "gguf" if path is not None and path.suffix == ".gguf" else "safetensors"
    return {"parent_model": "", "format": fmt, "family": family, "families": [family] if family else None,
            "parameter_size": _parameter_size(config) if config is not None else "",
            "quantization_level": "" if quant == "none" else quant}


def _parameter_size(c) -> str:
    """The dense decoder's parameter count from its shape ("134.5M"): embeddings, attention, MLP and norms."""
    attention = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    layer = attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    n = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.num_layers * layer + c.hidden_size
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _model_info(c, context: int | None) -> dict:
    """Ollama's `model_info` keys (GGUF metadata names) for the architecture, `<arch>.context_length` the served one."""
    if c is None:
        return {}
    arch = c.architecture.lower().removesuffix("forcausallm")
    return {"general.architecture": arch, f"{arch}.context_length": context, f"{arch}.embedding_length": c.hidden_size,
            f"{arch}.block_count": c.num_layers, f"{arch}.feed_forward_length": c.intermediate_size,
            f"{arch}.attention.head_count": c.num_heads, f"{arch}.attention.head_count_kv": c.num_kv_heads,
            f"{arch}.vocab_size": c.vocab_size, f"{arch}.rope.freq_base": c.rope_theta}
