"""The StartGate (server/gate.py): what `lmserve serve` answers between opening its port and having its app.

The real server's start is in tests/test_serve_start.py; here the gate runs alone under Starlette's TestClient,
with a small Starlette app standing in for the real one (the gate passes requests to whatever app it is given).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from lmserve.server.gate import StartGate


def stand_in_app(events: list[str]) -> Starlette:
    """An app with a lifespan (recorded in `events`) and one route."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        events.append("startup")
        yield
        events.append("shutdown")

    async def chat(request):
        return JSONResponse({"answered": True})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])], lifespan=lifespan)


def test_the_probes_say_loading_before_the_app_exists():
    with TestClient(StartGate(timeout=5)) as client:
        r = client.get("/health")
        assert r.status_code == 503
        assert r.json() == {"status": "loading",
                            "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        assert client.get("/v2/health/ready").status_code == 503
        r = client.get("/v2/health/live")
        assert r.status_code == 200 and r.json() == {"live": True}


def test_a_request_waits_for_the_app_and_is_served_by_it():
    gate, events, counted = StartGate(timeout=30), [], []
    with TestClient(gate) as client:
        assert client.get("/health").status_code == 503

        def open_later():
            time.sleep(0.3)
            import asyncio

            asyncio.run_coroutine_threadsafe(gate.open(stand_in_app(events), counted.append), gate.loop).result()

        opener = threading.Thread(target=open_later)
        start = time.monotonic()
        opener.start()
        r = client.post("/v1/chat/completions", json={})
        waited = time.monotonic() - start
        opener.join()
        assert r.status_code == 200 and r.json() == {"answered": True}
        assert waited >= 0.3 and events == ["startup"]  # the app's lifespan ran before it served
        assert counted == [503]  # the gate's own /health answer, handed to the app's metrics
    assert events == ["startup", "shutdown"]  # and ended with the gate's


def test_a_wait_past_the_timeout_is_503_in_the_family_s_error_body():
    with TestClient(StartGate(timeout=0.2)) as client:
        openai = client.post("/v1/chat/completions", json={})
        assert openai.status_code == 503 and openai.headers["Retry-After"] == "5"
        assert openai.json()["error"]["type"] == "service_unavailable" and "loading" in openai.json()["error"]["message"]
        anthropic = client.post("/v1/messages", json={})
        assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "overloaded_error"
        ollama = client.post("/api/chat", json={})
        assert ollama.status_code == 503 and "loading" in ollama.json()["error"]


def test_a_failed_start_answers_waiting_requests_at_once():
    gate = StartGate(timeout=30)
    with TestClient(gate) as client:
        threading.Timer(0.2, gate.fail).start()
        start = time.monotonic()
        r = client.post("/v1/chat/completions", json={})
        assert time.monotonic() - start < 10
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert client.get("/v2/health/live").status_code == 503  # nothing serves the live probe as the process ends


def test_the_serve_entry_imports_no_torch():
    """What `lmserve serve` imports before it listens: no torch, numpy or pydantic (they load behind the port)."""
    code = ("import sys, lmserve.cli, lmserve.server.start; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'pydantic'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
