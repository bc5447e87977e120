"""Server pieces that need no model: strict JSON, naming, keys, and /health through the engine's lifecycle."""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from lmserve.server.app import build_app
from lmserve.server.errors import APIError, excerpt
from lmserve.server.key_file import key_specs, plain_name
from lmserve.server.main import served_name
from lmserve.server.metrics import ServerMetrics
from lmserve.server.models.pool import ModelPool, ModelSpec
from lmserve.server.protocol import CompletionRequest, load_json, parse_body
from lmserve.server.state import ServerConfig, ServerState
from lmserve.server.tenants import Tenants


@pytest.mark.parametrize("raw,match", [
    (b'{"a": NaN}', "NaN"), (b'{"a": -Infinity}', "Infinity"), (b'{"a": 1e999}', "out of range"),
    (b'{"a": "\\udc00"}', "surrogate"), (b"[" * 50000 + b"]" * 50000, "nested too deeply"),
    (b"\xff\xfe", "not valid JSON"), (b'{"a": 1' + b"0" * 5000 + b"}", "not valid JSON"),
])
def test_strict_json_rejects(raw, match):
    with pytest.raises(APIError) as e:
        load_json(raw)
    assert e.value.status == 400 and match in e.value.message


def test_strict_json_keeps_surrogate_pairs():
    assert load_json(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001F600"}


def test_an_excerpt_quotes_only_the_start_of_any_input():
    assert excerpt("abc") == "'abc'" and excerpt("x" * 100) == "'" + "x" * 39 + "...'"
    quoted = []

    class Value:
        def __repr__(self) -> str:
            quoted.append(1)
            return "v"

    # a bounded repr: the whole one of a refused 100k-key logit_bias (1.2 MB) held the GIL for ~90 ms
    text = excerpt({str(i): Value() for i in range(100_000)})
    assert text.startswith("{'0': v, '1': v") and len(text) <= 44 and len(quoted) <= 8
    huge = {str(i): 1 for i in range(100_000)}
    with pytest.raises(APIError, match=r"logit_bias: Dictionary should have at most 65536 items"):
        parse_body(json.dumps({"prompt": "hi", "logit_bias": huge}).encode(), CompletionRequest)


def test_nulls_mean_defaults_and_types_are_strict():
    req = parse_body(b'{"model": "m", "prompt": "x", "temperature": null, "n": null, "tools": null}',
                     CompletionRequest)
    assert req.temperature == 1.0 and req.n == 1
    with pytest.raises(APIError, match="max_tokens"):
        parse_body(b'{"model": "m", "prompt": "x", "max_tokens": "5"}', CompletionRequest)


@pytest.mark.parametrize("model,name", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"), ("Llama-3.2-1B-Instruct-Q4_K_M.gguf",
                                                                   "Llama-3.2-1B-Instruct"),
    ("qwen2.5-0.5b-instruct-bf16.gguf", "qwen2.5-0.5b-instruct"), ("Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B-Instruct"),
])
def test_served_name_from_the_model_path(tmp_path, model, name):
    path = tmp_path / model
    path.mkdir() if not model.endswith(".gguf") else path.write_bytes(b"")
    assert served_name(argparse.Namespace(served_model_name=None, model=str(path)), path) == name
    assert served_name(argparse.Namespace(served_model_name="given", model=str(path)), path) == "given"


def test_served_name_of_a_hub_id_is_the_id(tmp_path):
    snapshot = tmp_path / "snapshots" / "0123abcd"  # where the Hub cache keeps it: not a name for clients
    assert served_name(argparse.Namespace(served_model_name=None, model="org/name"), snapshot) == "org/name"


def test_default_served_name():
    from lmserve.loader import default_model_path

    args = argparse.Namespace(served_model_name=None, model=None)
    assert served_name(args, default_model_path()) == "SmolLM2-135M-Instruct"


def test_api_key_check():
    keys = Tenants(key_specs(("alpha", "beta", ""), ()))  # an empty key is never accepted
    assert (keys.identify("Bearer alpha"), keys.identify("bearer beta")) == (plain_name("alpha"), plain_name("beta"))
    assert not any(keys.identify(h) for h in ("", "alpha", "Bearer alph", "Bearer alphaa", "Basic alpha", "Bearer "))


def test_health_follows_the_engine_lifecycle():
    state = ServerState(ServerConfig("m"), ServerMetrics("m"), models=ModelPool([ModelSpec("m")], load_timeout=0.3))
    state.starting = True  # as server/start.py has it while the start-up load runs
    client = TestClient(build_app(state))
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "loading" and r.json()["error"]["code"] == 503
    start = time.monotonic()
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})  # waits out --model-load-timeout
    assert time.monotonic() - start >= 0.3
    assert r.status_code == 503 and r.headers["Retry-After"] and "loading" in r.json()["error"]["message"]
    state.async_engine = SimpleNamespace(alive=True)
    assert client.get("/health").status_code == 200
    state.async_engine = SimpleNamespace(alive=False)  # the engine thread died
    assert client.get("/health").json() == {"status": "dead"}
    assert client.post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 503
    state.async_engine, state.draining = SimpleNamespace(alive=True), True
    assert client.get("/health").json() == {"status": "draining"}


def test_a_failed_load_says_failed_and_answers_waiting_requests_at_once():
    state = ServerState(ServerConfig("m"), ServerMetrics("m"), models=ModelPool([ModelSpec("m")], load_timeout=60))
    state.starting, state.load_error = True, "CheckpointError: missing tensors"  # as server/start._load sets it
    client = TestClient(build_app(state))
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "failed" and "missing" not in r.text  # no file names
    start = time.monotonic()
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert time.monotonic() - start < 5  # not the 60 s load wait
    assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]


def test_echo_and_logprobs_ask_the_engine_for_prompt_logprobs():
    from lmserve.server.api.params import completion_params

    def params(**kw):
        return completion_params(CompletionRequest(model="m", prompt="x", **kw))

    assert params(echo=True, logprobs=2).prompt_logprobs == 2 and params(logprobs=2).prompt_logprobs is None
    assert params(prompt_logprobs=4, logprobs=1, echo=True).prompt_logprobs == 4  # vLLM's extra wins
    assert params(echo=True, max_tokens=0).max_tokens == 1  # scoring: one sampled token, dropped by the route
    with pytest.raises(APIError, match="0 is allowed with echo"):
        params(max_tokens=0)


def test_prompt_logprob_formats():
    from lmserve.request import TokenLogprobs
    from lmserve.server.api.logprobs import completion_logprobs, vllm_prompt_logprobs

    def piece(i: int) -> str:
        return f"<{i}>"

    lps = [None, TokenLogprobs(5, -1.5, [(7, -0.5), (5, -1.5)], rank=2), TokenLogprobs(6, float("-inf"), [], rank=9)]
    legacy = completion_logprobs(piece, [4, 5, 6], lps, start=3)
    assert legacy == {"tokens": ["<4>", "<5>", "<6>"], "token_logprobs": [None, -1.5, -9999.0],
                      "top_logprobs": [None, {"<7>": -0.5, "<5>": -1.5}, {}], "text_offset": [3, 6, 9]}
    vllm = vllm_prompt_logprobs(piece, lps)
    assert vllm[0] is None and list(vllm[1]) == [5, 7]  # the prompt's own token first
    assert vllm[1][5] == {"logprob": -1.5, "rank": 2, "decoded_token": "<5>"}
    assert vllm[1][7] == {"logprob": -0.5, "rank": 1, "decoded_token": "<7>"}
    assert vllm[2] == {6: {"logprob": -9999.0, "rank": 9, "decoded_token": "<6>"}}  # -inf is not JSON
    assert vllm_prompt_logprobs(piece, None) is None


def test_chat_logprobs_of_masked_alternatives_are_finite():
    """A grammar masks alternatives to -inf: JSON has no such number, and a browser's JSON.parse refuses the chunk."""
    from lmserve.request import TokenLogprobs
    from lmserve.server.api.logprobs import chat_logprobs

    [entry] = chat_logprobs(str, [TokenLogprobs(5, -0.5, [(5, -0.5), (6, float("-inf"))])])
    assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.5, -9999.0]
    json.dumps(entry, allow_nan=False)
