"""The pieces every OpenAPI row is made of (server/api/openapi.py's document; each dialect's rows in its
`<dialect>/openapi.py`): RouteDoc, the media types, the answer models' base and the usual error statuses."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

JSON, SSE, TEXT, HTML, NDJSON = "application/json", "text/event-stream", "text/plain", "text/html", "application/x-ndjson"
CSS, JS = "text/css", "text/javascript"
MULTIPART, OCTETS = "multipart/form-data", "application/octet-stream"
# 401 on every route but /health (API keys); 413 wherever a body is read; 429 per-key limits; 503 not ready.
GEN_ERRORS = (400, 401, 404, 413, 429, 500, 503)


class Open(BaseModel):
    """An answer model: it promises fields, not their absence (extra fields allowed)."""

    model_config = ConfigDict(extra="allow")


@dataclass(frozen=True)
class RouteDoc:
    """What one operation takes (`body`) and answers with 200 (`answer`, in `media`), and its error statuses."""

    body: type[BaseModel] | None
    answer: type[BaseModel] | None
    errors: tuple[int, ...]
    media: tuple[str, ...] = (JSON,)
    body_media: str = JSON


class TGIError(Open):
    """The error body of Hugging Face's servers: TGI's routes (/, /generate, /generate_stream, /info) and TEI's /embed
    (server/api/hf_body.py writes it)."""

    error: str
    error_type: str


class Version(Open):
    version: str
