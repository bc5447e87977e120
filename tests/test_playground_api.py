"""The playground's HTTP side, in process and without a model: the page and its files, the share routes.

Shares: create, read, list, delete; unknown ids are 404 in OpenAI's error shape; bad bodies 400; big
ones 413; listing and deleting are per API key name, reading by id is for any valid key.
"""

from __future__ import annotations

import json
import re

import pytest
from starlette.testclient import TestClient

from lmserve.server.app import build_app
from lmserve.server.key_file import KeySpec, key_digest
from lmserve.server.metrics import ServerMetrics
from lmserve.server.playground.routes import MAX_SHARE_BYTES, SHARES
from lmserve.server.playground.store import ShareStore
from lmserve.server.state import ServerConfig, ServerState

M = "m"
KEY_A, KEY_B = "key-of-team-a", "key-of-team-b"
A, B = ({"Authorization": f"Bearer {k}"} for k in (KEY_A, KEY_B))


def share_body(**changes) -> dict:
    body = {"mode": "chat", "model": M, "system": "Be brief.", "prompt": "Say hi\nplease",
            "params": {"temperature": 0.5, "top_p": 1, "top_k": None, "max_tokens": 8, "stop": ["\n\n"], "seed": 3,
                       "presence_penalty": 0, "frequency_penalty": 0, "response_format": None},
            "output": {"text": "Hi!", "finish_reason": "stop",
                       "tokens": [{"token": "Hi", "logprob": -0.1, "top": [{"token": "Hi", "logprob": -0.1},
                                                                           {"token": "Hello", "logprob": -2.5}]},
                                  {"token": "!", "logprob": 0, "top": []}]}}
    return {**body, **changes}


@pytest.fixture()
def client(tmp_path) -> TestClient:
    keys = (KeySpec("team-a", key_digest(KEY_A)), KeySpec("team-b", key_digest(KEY_B)))
    state = ServerState(ServerConfig(M, named_keys=keys), ServerMetrics(M), playground=ShareStore(tmp_path / "p.db"))
    return TestClient(build_app(state), raise_server_exceptions=False)


def assert_openai_error(r, status: int) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_create_read_list_delete(client):
    created = client.post(SHARES, headers=A, json=share_body()).json()
    assert len(created["id"]) == 22 and created["url"] == f"/p/{created['id']}"
    assert created["title"] == "Say hi" and created["mode"] == "chat"
    got = client.get(f"{SHARES}/{created['id']}", headers=A).json()
    assert {k: got[k] for k in share_body() if k != "title"} == share_body()  # exactly what was saved
    assert [s["id"] for s in client.get(SHARES, headers=A).json()["data"]] == [created["id"]]
    assert client.delete(f"{SHARES}/{created['id']}", headers=A).json() == {
        "id": created["id"], "object": "playground.share", "deleted": True}
    assert_openai_error(client.get(f"{SHARES}/{created['id']}", headers=A), 404)
    assert client.get(SHARES, headers=A).json()["data"] == []


def test_ids_are_unguessable_and_titles_given_or_derived(client):
    ids = {client.post(SHARES, headers=A, json=share_body(title="mine")).json()["id"] for _ in range(20)}
    assert len(ids) == 20
    assert {s["title"] for s in client.get(SHARES, headers=A).json()["data"]} == {"mine"}
    empty = client.post(SHARES, headers=A, json=share_body(prompt="  \n")).json()
    assert empty["title"] == "(empty prompt)"


def test_a_share_is_readable_by_any_key_but_listed_and_deleted_only_by_its_own(client):
    share_id = client.post(SHARES, headers=A, json=share_body()).json()["id"]
    assert client.get(f"{SHARES}/{share_id}", headers=B).status_code == 200  # the permalink is to be passed on
    assert client.get(SHARES, headers=B).json()["data"] == []
    assert_openai_error(client.delete(f"{SHARES}/{share_id}", headers=B), 404)
    assert client.get(f"{SHARES}/{share_id}", headers=A).status_code == 200


@pytest.mark.parametrize("share_id", ["x", "A" * 22, "../../etc/passwd", "%00" * 8, "a" * 65])
def test_unknown_ids_are_404_in_openai_shape(client, share_id):
    assert_openai_error(client.get(f"{SHARES}/{share_id}", headers=A), 404)
    assert_openai_error(client.delete(f"{SHARES}/{share_id}", headers=A), 404)


@pytest.mark.parametrize("raw", [b"", b"not json", b"[]", b'{"mode": "chat"}', b"{" * 5000,
                                 json.dumps(share_body(mode="poem")).encode(),
                                 json.dumps(share_body(extra=1)).encode(),
                                 json.dumps(share_body(params={"temperature": "hot"})).encode(),
                                 json.dumps(share_body(params={"api_key": "sk"})).encode(),
                                 b'{"mode": "chat", "logprob": NaN}'])
def test_bad_bodies_are_400(client, raw):
    assert_openai_error(client.post(SHARES, headers={**A, "Content-Type": "application/json"}, content=raw), 400)


def test_a_share_over_the_size_limit_is_413(client):
    big = share_body(prompt="x" * MAX_SHARE_BYTES)
    assert_openai_error(client.post(SHARES, headers=A, json=big), 413)
    assert client.get(SHARES, headers=A).json()["data"] == []


def test_the_page_and_its_files_need_no_key_but_the_data_routes_do(client):
    for path in ("/", "/playground", "/p/" + "a" * 22):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["referrer-policy"] == "no-referrer"  # a permalink's id must not leak to other sites
    for name in ("app.js", "tokens.js", "export.js", "style.css"):
        assert client.get(f"/playground/assets/{name}").status_code == 200, name
    assert_openai_error(client.get("/playground/assets/missing.js"), 404)
    for method, path in (("GET", SHARES), ("POST", SHARES), ("GET", f"{SHARES}/{'a' * 22}"), ("GET", "/v1/models"),
                         ("POST", "/")):  # POST / is TGI's generate: only GET / is the page
        assert client.request(method, path, json={}).status_code == 401, (method, path)


def test_the_page_loads_nothing_from_elsewhere(client):
    html = client.get("/").text
    assert not re.search(r'(src|href)="(https?:)?//', html)
    for name in ("app.js", "tokens.js", "export.js", "style.css"):
        text = client.get(f"/playground/assets/{name}").text
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text, name  # model output is text
        assert "https://" not in text and "@import" not in text, name


def test_no_playground_answers_404(tmp_path):
    c = TestClient(build_app(ServerState(ServerConfig(M), ServerMetrics(M))), raise_server_exceptions=False)
    for path in ("/", "/playground", "/playground/assets/app.js", SHARES):
        assert c.get(path).status_code == 404, path
