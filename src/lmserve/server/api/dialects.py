"""The registry: every API dialect, one name each (the order is the routes' order). The app, the
error bodies and the OpenAPI document iterate it; adding a dialect is its folder plus its name here.

Torch-free, as each dialect's `__init__` is: the StartGate (server/gate.py) answers errors with it while the
routes load.
"""

from __future__ import annotations

from importlib import import_module

from starlette.responses import JSONResponse

from lmserve.server.api.dialect import Dialect
from lmserve.server.errors import APIError, error_body, respond

# Each dialect's folder under server/api/, in the routes' order: adding one is its folder and its name here.
NAMES = ("openai", "anthropic", "responses", "tgi", "lora", "kserve", "ollama", "embeddings", "retrieval")
DIALECTS: tuple[Dialect, ...] = tuple(import_module(f"lmserve.server.api.{name}").DIALECT for name in NAMES)


def is_generation(path: str) -> bool:
    """A route that generates: the Observe middleware keeps one record of it (and settles the key's usage)."""
    return any(d.generates(path) for d in DIALECTS)


def dialect_of_errors(path: str) -> Dialect | None:
    """The dialect whose error body `path` answers in; None: OpenAI's."""
    return next((d for d in DIALECTS if d.answers_errors_of(path)), None)


def error_response(path: str, err: APIError) -> JSONResponse:
    """The body and status for `err` in the dialect of `path`."""
    dialect = dialect_of_errors(path)
    return respond(error_body(err), err) if dialect is None else dialect.error_response(err)
