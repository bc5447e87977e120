"""What one API dialect (server/api/<dialect>/) exports: a `Dialect`, its entry in server/api/dialects.py.

The app, the error bodies and the OpenAPI document iterate the registry and name no dialect. A dialect's
`__init__.py` declares its Dialect with what must be known before torch is imported (the StartGate answers errors
in the right body while the routes load: its paths and error body); what needs the engine's imports (its router
and stream encoder, in `<dialect>/routes.py`) or the document's models (its rows, in `<dialect>/openapi.py`) is
imported on first use, so the registry itself stays torch- and pydantic-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Callable

from starlette.responses import JSONResponse

from lmserve.server.errors import APIError


@dataclass(frozen=True)
class Dialect:
    """One API dialect: `package` is its folder's module (`lmserve.server.api.<name>`)."""

    name: str
    package: str
    # POSTs the Observe middleware records as generation requests (one RequestRecord each), exact or by pattern
    generation_paths: tuple[str, ...] = ()
    generation_pattern: re.Pattern | None = None
    # The paths whose errors this dialect answers in its own body (exact paths, or prefixes); others get OpenAI's
    error_paths: tuple[str, ...] = ()
    error_prefixes: tuple[str, ...] = ()
    error_response: Callable[[APIError], JSONResponse] | None = None
    open_paths: tuple[str, ...] = ()  # served without an API key (probes carry none)

    def answers_errors_of(self, path: str) -> bool:
        return self.error_response is not None and (path in self.error_paths or path.startswith(self.error_prefixes))

    def generates(self, path: str) -> bool:
        return path in self.generation_paths or (self.generation_pattern is not None
                                                 and self.generation_pattern.match(path) is not None)

    @property
    def routes(self) -> Any:
        """`<package>.routes`: `router` (its Starlette routes) and, for a streaming dialect, `ENCODER`."""
        return import_module(f"{self.package}.routes")

    @property
    def router(self) -> Any:
        return self.routes.router

    @property
    def encoder(self) -> Any:
        """Its StreamEncoder (server/streams.py); None when it does not stream or builds one per stream (Responses:
        its events are numbered per response)."""
        return getattr(self.routes, "ENCODER", None)

    @property
    def openapi(self) -> Any:
        """`<package>.openapi`: `ROUTES` (its RouteDoc rows) and `ERROR_MODEL` (its error body's model, or None)."""
        return import_module(f"{self.package}.openapi")

    @property
    def rule_models(self) -> tuple[Any, ...]:
        """The request bodies whose fields a validation rule (ops/rules.py) may name: `RULE_MODELS` in its openapi
        module (OpenAI's and TGI's bodies; none elsewhere)."""
        return getattr(self.openapi, "RULE_MODELS", ())
