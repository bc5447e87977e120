"""A dialect is a plugin (issue 45): each server/api/<dialect>/ exports one Dialect, and the app, the error bodies and
the OpenAPI document iterate the registry (server/api/dialects.py) without naming a dialect."""

from __future__ import annotations

import re
from pathlib import Path

from lmserve.server.api.dialects import DIALECTS, error_response
from lmserve.server.errors import APIError

SERVER = Path(__file__).resolve().parents[1] / "src" / "lmserve" / "server"
CENTRAL = ("app.py", "errors.py", "gate.py", "api/openapi.py")


def test_each_dialect_is_one_folder_with_its_routes_and_rows():
    assert len({d.name for d in DIALECTS}) == len(DIALECTS)
    for d in DIALECTS:
        assert d.package == f"lmserve.server.api.{d.name}" and (SERVER / "api" / d.name / "routes.py").is_file()
        served = {(m.lower(), path) for path, methods, _ in d.router.endpoints for m in methods}
        assert served == set(d.openapi.ROUTES), d.name  # every route documented beside it, nothing else


def test_the_central_modules_name_no_dialect():
    names = "|".join(d.name for d in DIALECTS)
    for module in CENTRAL:
        found = re.findall(rf"lmserve\.server\.api\.(?:{names})\b|server\.api import .*\b(?:{names})\b",
                           (SERVER / module).read_text())
        assert not found, (module, found)


def test_errors_answer_in_the_dialect_of_the_path():
    err = APIError(400, "bad")
    assert error_response("/v1/messages", err).body.startswith(b'{"type":"error"')
    assert error_response("/generate", err).status_code == 422  # TGI answers invalid input with 422
    assert error_response("/api/chat", err).body == b'{"error":"bad"}'
    assert error_response("/v2/models/m/infer", err).body == b'{"error":"bad"}'
    assert b'"invalid_request_error"' in error_response("/v1/chat/completions", err).body
