"""KServe's Open Inference Protocol (v2): health, model metadata and readiness, text inference and its errors,
against the real server on the embedded model (behind an API key: only the health probes are open)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_util import MODEL, running_server

KEY = "v2-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
INFER = f"/v2/models/{MODEL}/infer"


@pytest.fixture(scope="module")
def v2():
    with running_server("--api-key", KEY, "--metrics-public", headers=AUTH) as s:  # wait_idle reads /metrics
        yield s


def text_input(*texts: str, **overrides) -> dict:
    return {"name": "text_input", "shape": [len(texts)], "datatype": "BYTES", "data": list(texts), **overrides}


def post(server, body, path: str = INFER, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_health_is_open_like_health(v2):
    assert httpx.get(v2.url + "/v2/health/live").json() == {"live": True}
    assert httpx.get(v2.url + "/v2/health/ready").json() == {"ready": True}


def test_model_metadata_and_ready_need_the_key(v2):
    r = httpx.get(v2.url + f"/v2/models/{MODEL}")
    assert r.status_code == 401 and set(r.json()) == {"error"}
    meta = httpx.get(v2.url + f"/v2/models/{MODEL}", headers=AUTH).json()
    assert meta["name"] == MODEL and meta["inputs"] == [{"name": "text_input", "datatype": "BYTES", "shape": [-1]}]
    assert meta["outputs"][0]["name"] == "text_output"
    assert httpx.get(v2.url + f"/v2/models/{MODEL}/ready", headers=AUTH).json() == {"name": MODEL, "ready": True}
    for path in ("/v2/models/nope", "/v2/models/nope/ready"):
        r = httpx.get(v2.url + path, headers=AUTH)
        assert r.status_code == 404 and "nope" in r.json()["error"]


def test_infer_matches_the_completions_route(v2):
    params = {"max_tokens": 8, "temperature": 0}
    r = post(v2, {"id": "req-1", "inputs": [text_input("The capital of France is", "Once upon a time")],
                  "parameters": params})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == MODEL and body["id"] == "req-1"
    [out] = body["outputs"]
    assert out["name"] == "text_output" and out["datatype"] == "BYTES" and out["shape"] == [2]
    c = openai.OpenAI(base_url=v2.url + "/v1", api_key=KEY, max_retries=0)
    for prompt, text in zip(("The capital of France is", "Once upon a time"), out["data"]):
        assert c.completions.create(model=MODEL, prompt=prompt, **params).choices[0].text == text
    assert body["parameters"]["completion_tokens"] == 16 and body["parameters"]["finish_reason"] == ["length"] * 2


@pytest.mark.parametrize("body, status, says", [
    ({"inputs": [text_input("x", datatype="FP32")]}, 400, "BYTES"),
    ({"inputs": [text_input("x", name="prompt")]}, 400, "text_input"),
    ({"inputs": [text_input("x", shape=[2])]}, 400, "shape"),
    ({"inputs": [text_input("x", shape=[1, 1])]}, 400, "shape"),
    ({"inputs": [{**text_input("x"), "data": [3]}]}, 400, "strings"),
    ({"inputs": []}, 400, "inputs"),
    ({"inputs": [text_input("x"), text_input("y")]}, 400, "inputs"),
    ({"inputs": [text_input("x")], "outputs": [{"name": "logits"}]}, 400, "text_output"),
    ({"inputs": [text_input("x")], "parameters": {"temperature": -1}}, 400, "temperature"),
    ({"inputs": [text_input("x")], "parameters": {"beam_width": 2}}, 400, "beam_width"),
    ({"inputs": [text_input("x")], "extra": 1}, 400, "extra"),
    ({"inputs": [text_input("x")], "parameters": {"max_tokens": 10**9}}, 400, "max_tokens"),
])
def test_infer_errors_are_v2_error_objects(v2, body, status, says):
    r = post(v2, body)
    assert r.status_code == status and set(r.json()) == {"error"} and says in r.json()["error"], r.text


def test_infer_refuses_unknown_models_bad_json_and_missing_keys(v2):
    ok = {"inputs": [text_input("x")], "parameters": {"max_tokens": 1}}
    r = post(v2, ok, path="/v2/models/nope/infer")
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = httpx.post(v2.url + INFER, content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = post(v2, ok, headers={})
    assert r.status_code == 401 and set(r.json()) == {"error"}
    assert post(v2, ok).status_code == 200  # none of that harmed the server
    v2.wait_idle()
