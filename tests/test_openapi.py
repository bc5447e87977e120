"""/openapi.json describes every route of the app: request bodies, answers and error bodies (schemathesis fuzzes it)."""

from __future__ import annotations

import subprocess
import sys

from tests.test_auth_coverage import KEY, OPEN, app_client, filled, route_templates

# POST routes whose body is not JSON, or that take none
BODY_MEDIA = {"/v1/files": "multipart/form-data", "/v1/batches/{batch_id}/cancel": None}


def test_every_route_is_documented_with_bodies_answers_and_errors():
    client = app_client(api_keys=(KEY,))
    doc = client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    routes = route_templates(client)
    assert ("GET", "/v1/batches/{batch_id}") in routes  # templates, as the document names them
    for method, path in routes:
        if path == "/openapi.json" or method == "HEAD":
            continue
        op = doc["paths"].get(path, {}).get(method.lower())
        assert op is not None, f"{method} {path} is not in /openapi.json"
        assert "200" in op["responses"] and op["responses"]["200"]["content"], (method, path)
        if method == "POST":
            media = BODY_MEDIA.get(path, "application/json")
            if media is not None:
                assert op["requestBody"]["content"][media]["schema"]["$ref"], path
            assert {"401", "413"} <= set(op["responses"]), path
            assert "503" in op["responses"] or path.startswith(("/v1/files", "/v1/batches")), path
        if (method, filled(path)) not in OPEN or "401" in op["responses"]:  # the open ones never answer 401
            error = op["responses"]["401"]["content"]["application/json"]["schema"]["$ref"]
            family = "TGIError" if path in ("/", "/generate", "/generate_stream", "/info", "/embed") \
                else "V2Error" if path.startswith(("/v2/models", "/v2/health")) else "OllamaError" if path.startswith("/api/") \
                else "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
            assert error.endswith(family), path


# Building the app and answering a request import no FastAPI (~0.25 s of every start, issue 32); the first
# /openapi.json imports it to generate the document.
LAZY_FASTAPI = """
import sys
from starlette.testclient import TestClient
from lmserve.server.app import build_app
from lmserve.server.metrics import ServerMetrics
from lmserve.server.state import ServerConfig, ServerState
client = TestClient(build_app(ServerState(ServerConfig("m"), ServerMetrics("m"))))
assert client.get("/version").status_code == 200 and client.get("/v1/models").status_code == 200
assert client.get("/v1/batches?limit=x").status_code == 400
print("fastapi" in sys.modules, flush=True)
assert "/v1/completions" in client.get("/openapi.json").json()["paths"]
print("fastapi" in sys.modules)
"""


def test_fastapi_is_imported_by_the_first_openapi_request_only():
    out = subprocess.run([sys.executable, "-c", LAZY_FASTAPI], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]
