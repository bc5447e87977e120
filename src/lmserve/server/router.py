"""The APIRouter every API family's routes hang on: what a route returns is its answer, as is.

FastAPI infers a response model from each endpoint's return annotation (`-> dict` of most of ours) and builds a
pydantic field for it: ~2 ms of every one of the ~45 routes at start (issue 32: start to first token), only to
re-validate a dict the route built itself. The routes answer plain JSON (and Response objects), and
server/api/openapi.py documents the answers; so a route here infers no response model unless it names one.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter
from fastapi.datastructures import DefaultPlaceholder


class Router(APIRouter):
    def add_api_route(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if isinstance(kwargs.get("response_model", DefaultPlaceholder(None)), DefaultPlaceholder):
            kwargs["response_model"] = None
        super().add_api_route(path, endpoint, **kwargs)
