"""The router every API family's routes hang on: Starlette routes whose endpoints read the Request themselves.

Routes read and check their bodies themselves (protocol.parse_body) and answer plain JSON or Response objects, so
they need none of FastAPI's request parsing; FastAPI itself costs ~0.2-0.3 s of imports and per-route analysis at
every start (issue 32: start to first token). An endpoint here is `async def f(request, <path params>, <query
params with defaults>)`: path parameters arrive by name, a query parameter is converted to its annotated type (int
or str; a bad value is a 400 naming it), and a returned dict becomes a JSON answer. server/api/openapi.py documents
the same endpoints through FastAPI's generator, imported on the first /openapi.json only.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lmserve.server.errors import APIError

Endpoint = Callable[..., Awaitable[Any]]


class Router:
    """An API family's routes, in the order they were declared (Starlette matches in that order)."""

    def __init__(self) -> None:
        self.routes: list[Route] = []
        self.endpoints: list[tuple[str, tuple[str, ...], Endpoint]] = []  # (path, methods, endpoint): the docs'

    def add(self, path: str, methods: tuple[str, ...], endpoint: Endpoint) -> None:
        route = Route(path, _handler(endpoint), methods=list(methods), name=endpoint.__name__)
        if "HEAD" not in methods:  # Starlette adds HEAD to every GET; a route answers the methods it names (and
            route.methods.discard("HEAD")  # documents), as it did under FastAPI: 405 otherwise
        self.routes.append(route)
        self.endpoints.append((path, methods, endpoint))

    def include(self, other: Router) -> None:
        self.routes += other.routes
        self.endpoints += other.endpoints

    def _method(self, path: str, *methods: str) -> Callable[[Endpoint], Endpoint]:
        def register(endpoint: Endpoint) -> Endpoint:
            self.add(path, methods, endpoint)
            return endpoint

        return register

    def get(self, path: str) -> Callable[[Endpoint], Endpoint]:
        return self._method(path, "GET")

    def post(self, path: str) -> Callable[[Endpoint], Endpoint]:
        return self._method(path, "POST")

    def delete(self, path: str) -> Callable[[Endpoint], Endpoint]:
        return self._method(path, "DELETE")

    def head(self, path: str) -> Callable[[Endpoint], Endpoint]:
        return self._method(path, "HEAD")


def _handler(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    """The Starlette endpoint around `endpoint`: its arguments from the request, its answer as a Response."""
    params = inspect.signature(endpoint).parameters
    takes_request = "request" in params
    query = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    kinds = _query_types(endpoint, query) if query else {}

    async def handle(request: Request) -> Response:
        kwargs: dict[str, Any] = {"request": request} if takes_request else {}
        kwargs.update((k, v) for k, v in request.path_params.items() if k in params)
        for name, default in query.items():
            raw = request.query_params.get(name)
            kwargs[name] = default if raw is None else _convert(name, raw, kinds[name])
        answer = await endpoint(**kwargs)
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    return handle


def _query_types(endpoint: Endpoint, query: dict[str, Any]) -> dict[str, type]:
    """int or str for each query parameter, from its annotation (`int`, `str`, `str | None`)."""
    hints = typing.get_type_hints(endpoint)
    kinds = {}
    for name in query:
        args = typing.get_args(hints[name]) or (hints[name],)
        kinds[name] = int if int in args else str
    return kinds


def _convert(name: str, raw: str, kind: type) -> Any:
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise APIError(400, f"query.{name}: Input should be a valid integer, unable to parse string as an "
                           "integer", param=name) from None
    return raw
