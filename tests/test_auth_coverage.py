"""Every route the app has refuses a missing or wrong API key, except /health (and /metrics with --metrics-public)
and the playground's page files; with a key file, /metrics is the one route a valid key needs the admin role for.

The test walks the app's own route table, so a route added later (batch, files, adapters, admin) is
covered without being listed here; an open route must be named in OPEN. In process, no model: the key
check runs before any route, and an open route only has to answer something but 401.
"""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

from lmserve.server.app import build_app
from lmserve.server.key_file import parse_key_file
from lmserve.server.metrics import ServerMetrics
from lmserve.server.state import ServerConfig, ServerState

M = "m"
KEY = "right-key"
# (method, path as route_calls fills it). The playground's page and its files are open: they hold no data,
# and a browser cannot send a key when it navigates to a page (the page asks for the key and sends it on every
# data call: shares, models, generation, which stay closed). "/p/x" is not here: "x" cannot be a share id, so it
# is no page and needs the key; tests/test_playground.py checks a real permalink opens without one.
OPEN = {("GET", "/health"), ("GET", "/v2/health/live"), ("GET", "/v2/health/ready"), ("GET", "/"), ("GET", "/playground"),
        ("GET", "/playground/assets/x")}
BAD_HEADERS = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"},
               {"x-api-key": "wrong"}, {"x-api-key": f"Bearer {KEY}"}, {"x-api-key": ""}]


def app_client(**config) -> TestClient:
    return TestClient(build_app(ServerState(ServerConfig(M, **config), ServerMetrics(M))), raise_server_exceptions=False)


def leaf_routes(routes, prefix: str = "") -> list[tuple[str, object]]:
    """(full path, route) of every endpoint."""
    leaves = []
    for route in routes:
        if hasattr(route, "routes") and not hasattr(route, "methods"):  # a Mount
            leaves += leaf_routes(route.routes, prefix + route.path)
        else:
            leaves.append((prefix + route.path, route))
    return leaves


def route_templates(client: TestClient) -> list[tuple[str, str]]:
    """(method, path template such as /p/{share_id}) for every method of every route."""
    return [(m, path) for path, route in leaf_routes(client.app.routes)
            for m in sorted(getattr(route, "methods", None) or ())]


def filled(template: str) -> str:
    """A concrete path: each path parameter filled with a dummy value."""
    return re.sub(r"\{[^}]+\}", "x", template)


def route_calls(client: TestClient) -> list[tuple[str, str]]:
    """(method, concrete path) for every method of every route."""
    return [(m, filled(t)) for m, t in route_templates(client)]


@pytest.fixture(scope="module")
def guarded():
    return app_client(api_keys=(KEY,))


def test_the_route_table_is_walked(guarded):
    paths = {p for _, p in route_calls(guarded)}
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "/metrics", "/openapi.json"} <= paths


def test_every_route_but_the_open_ones_refuses_a_missing_or_wrong_key(guarded):
    leaks = []
    for method, path in route_calls(guarded):
        for headers in BAD_HEADERS:
            status = guarded.request(method, path, headers=headers, json={}).status_code
            if (status == 401) == ((method, path) in OPEN):
                leaks.append((method, path, headers, status))
    assert not leaks, f"routes not in OPEN that answer without a valid key (or open ones that refuse): {leaks}"


def test_x_api_key_is_a_key_as_bearer_is(guarded):
    """Anthropic's clients send the key as `x-api-key`: every route takes it as it takes `Authorization: Bearer`."""
    for method, path in route_calls(guarded):
        for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
            assert guarded.request(method, path, headers=headers, json={}).status_code != 401, (method, path, headers)


def test_options_and_unknown_paths_need_the_key_too(guarded):
    assert guarded.options("/v1/completions").status_code == 401
    assert guarded.get("/v1/no-such-route").status_code == 401
    assert guarded.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_metrics_needs_the_key_unless_metrics_public():
    assert app_client(api_keys=(KEY,)).get("/metrics").status_code == 401
    public = app_client(api_keys=(KEY,), metrics_public=True)
    assert public.get("/metrics").status_code == 200
    assert public.get("/version").status_code == 401  # only /metrics opens


def test_with_plain_keys_only_no_key_reads_metrics(guarded):
    """Plain keys have no role: a server with only plain keys has no admin, so /metrics is 403 to each of them
    (and open to all with --metrics-public, whose scrapers send no key)."""
    r = guarded.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    public = app_client(api_keys=(KEY,), metrics_public=True)
    assert public.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert app_client().get("/metrics").status_code == 200  # no keys at all: an open server, /metrics too


def test_with_a_key_file_metrics_is_the_only_admin_route():
    """The walk again with valid keys from a key file: a user key is refused (403, OpenAI's shape) on /metrics and
    on no other route; an admin key reads it; --metrics-public opens it to all. A plain key has no role (it is
    a user beside a key file)."""
    named = tuple(parse_key_file("keys: [{name: user, key: user-key}, {name: ops, key: admin-key, role: admin}]", "f"))
    c = app_client(named_keys=named, api_keys=("plain-key",))
    forbidden = {}
    for key in ("user-key", "plain-key", "admin-key"):
        for method, path in route_calls(c):
            r = c.request(method, path, headers={"Authorization": f"Bearer {key}"}, json={})
            if r.status_code == 403:
                forbidden.setdefault(key, []).append((method, path, r.json()["error"]["type"]))
    assert forbidden == {k: [("GET", "/metrics", "permission_error")] for k in ("user-key", "plain-key")}, forbidden
    public = app_client(named_keys=named, metrics_public=True)
    assert public.get("/metrics").status_code == 200
    assert public.get("/metrics", headers={"Authorization": "Bearer user-key"}).status_code == 200


def test_no_cors_headers_by_default():
    c = app_client(api_keys=(KEY,))
    origin = {"Origin": "http://evil.example"}
    preflight = c.options("/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST",
                                                       "Access-Control-Request-Headers": "authorization"})
    simple = c.get("/health", headers=origin)
    for r in (preflight, simple):
        assert not any(h.startswith("access-control-") for h in r.headers), r.headers
