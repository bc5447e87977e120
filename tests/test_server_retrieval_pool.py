"""Encoders in the multi-model pool, black-box: a tiny BERT embedder, cross-encoder and classifier beside the
embedded chat model in one `lmserve serve`, behind an API key file. Per-key `models` refuse an encoder on every
retrieval route as they refuse a chat model (404, each route's own error body), and an encoder expires at the
operator's --keep-alive or at Ollama's per-request `keep_alive` (on /api/embed and /api/embeddings, within the
operator's bounds), unloads (/api/ps, /v1/models, the load metrics) and loads again on its next request. An
embedding's short step goes first beside the decoding chat model (worker/cpu_gate.py's counters)."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import httpx
import numpy as np
import ollama
import pytest

from lmserve.layers.kernels.native import native_module
from tests.encoder_models import build_encoder
from tests.server_util import running_server

KEYS = {"ops": "sk-pool-ops-0123456789", "chat-only": "sk-pool-chat-0123456789", "rag": "sk-pool-rag-0123456789"}
KEEP_S, KEEP_MAX_S = 8, 3600  # --keep-alive: long enough that a request's own checks finish inside it here
ENCODERS = ["emb", "ce", "cls"]
# (path, body, the error body's dialect): every route an encoder answers, each naming one the route serves
ROUTES = [
    ("/v1/embeddings", {"model": "emb", "input": "a dog"}, "openai"),
    ("/api/embed", {"model": "emb", "input": "a dog"}, "ollama"),
    ("/api/embeddings", {"model": "emb", "prompt": "a dog"}, "ollama"),
    ("/embed", {"model": "emb", "inputs": "a dog"}, "tei"),
    ("/v1/rerank", {"model": "ce", "query": "a", "documents": ["a dog", "the cat"]}, "openai"),
    ("/v2/rerank", {"model": "ce", "query": "a", "documents": ["a dog", "the cat"]}, "openai"),
    ("/rerank", {"model": "ce", "query": "a", "texts": ["a dog", "the cat"]}, "openai"),
    ("/v1/score", {"model": "emb", "text_1": "a", "text_2": ["a dog", "the cat"]}, "openai"),
    ("/classify", {"model": "cls", "input": ["a dog"]}, "openai"),
]


@pytest.fixture(scope="module")
def pooled(tmp_path_factory, smol_path):
    root = tmp_path_factory.mktemp("retrieval_pool")
    models = {"chat": smol_path, "emb": build_encoder(root, "bert"),
              "ce": build_encoder(root, "bert", num_labels=1, pooling=None),
              "cls": build_encoder(root, "bert", num_labels=3, pooling=None)}
    (root / "keys.yaml").write_text(f"""keys:
  - {{name: ops, key: {KEYS["ops"]}, role: admin}}
  - {{name: chat-only, key: {KEYS["chat-only"]}, models: [chat]}}
  - {{name: rag, key: {KEYS["rag"]}, models: [{", ".join(ENCODERS)}]}}
""")
    args = [a for name, path in models.items() for a in ("--model", f"{name}={path}")]
    with running_server(*args, "--api-key-file", str(root / "keys.yaml"), "--keep-alive", f"{KEEP_S}s",
                        "--keep-alive-max", f"{KEEP_MAX_S}s", headers=auth("ops"), start_timeout=300) as s:
        yield s


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[key]}"}


def post(server, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=auth(key), timeout=120)


def as_ollama(server, key: str) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120, headers=auth(key))


def loaded(server) -> dict[str, float]:
    """The loaded models by /api/ps (an admin sees all), each with the seconds until its keep-alive runs out.

    Read against the clock after the answer: the server dates `expires_at` from its own now while answering, so a
    clock read before the call sees up to the call's latency more than the keep-alive (a CI run: 600.002 s of 600)."""
    models = as_ollama(server, "ops").ps().models
    now = datetime.now(timezone.utc)
    return {m.model: (m.expires_at - now).total_seconds() for m in models}


def wait_unloaded(server, name: str, timeout: float) -> float:
    """Seconds until `name` leaves /api/ps (an AssertionError past `timeout`)."""
    start = time.monotonic()
    while name in loaded(server):
        assert time.monotonic() - start < timeout, f"{name} was never unloaded"
        time.sleep(0.1)
    return time.monotonic() - start


def count(server, metric: str, model: str) -> float:
    return server.metric(metric, f'model_name="{model}"')


def listed(server, key: str) -> dict[str, bool]:
    """/v1/models as `key` sees it: each model's id and whether it is loaded."""
    data = httpx.get(server.url + "/v1/models", headers=auth(key), timeout=30).json()["data"]
    return {m["id"]: m["loaded"] for m in data}


def refused_in_shape(r: httpx.Response, dialect: str) -> None:
    """A model the key may not use: 404, as for a chat model, in the route's own error body (by shape)."""
    assert r.status_code == 404, r.text
    body = r.json()
    if dialect == "openai":
        assert body["error"]["code"] == "model_not_found" and "do not have access" in body["error"]["message"]
    elif dialect == "ollama":
        assert list(body) == ["error"] and "do not have access" in body["error"]
    else:  # TEI's {"error", "error_type"}
        assert body["error_type"] == "not_found" and "do not have access" in body["error"]


# -- per-key `models`: first, while every model is loaded -----------------------------------------------------


def test_a_key_without_the_encoders_gets_the_refusal_a_chat_model_gets_on_every_route(pooled):
    before = pooled.metric("lmserve:key_rejections_total", 'key_name="chat-only",reason="model"')
    for path, body, dialect in ROUTES:
        refused_in_shape(post(pooled, "chat-only", path, body), dialect)
    assert pooled.metric("lmserve:key_rejections_total", 'key_name="chat-only",reason="model"') - before == len(ROUTES)
    assert listed(pooled, "chat-only").keys() == {"chat"}  # it does not see the encoders at all
    tags = httpx.get(pooled.url + "/api/tags", headers=auth("chat-only"), timeout=30).json()["models"]
    assert [m["name"] for m in tags] == ["chat"]
    done = post(pooled, "chat-only", "/v1/completions", {"model": "chat", "prompt": "Hi", "max_tokens": 2})
    assert done.status_code == 200, done.text  # its own model is served
    with pytest.raises(ollama.ResponseError) as e:  # the official client reads the refusal
        as_ollama(pooled, "chat-only").embed(model="emb", input="a dog")
    assert e.value.status_code == 404


def test_a_key_allowed_the_encoders_is_served_on_every_route_and_refused_the_chat_model(pooled):
    for path, body, _ in ROUTES:
        r = post(pooled, "rag", path, body)
        assert r.status_code == 200, (path, r.text)
    assert listed(pooled, "rag").keys() == set(ENCODERS)
    assert len(as_ollama(pooled, "rag").embed(model="emb", input=["a dog", "the cat"]).embeddings) == 2
    refused_in_shape(post(pooled, "rag", "/v1/chat/completions",
                          {"model": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
                     "openai")
    # a body that names no model asks for the default (the chat model): refused too, not served by an encoder
    refused_in_shape(post(pooled, "rag", "/v1/embeddings", {"input": "a dog"}), "openai")


# -- keep-alive: the encoder unloads, and loads again on its next request ------------------------------------


def test_an_idle_encoder_unloads_at_the_operators_keep_alive_and_its_next_request_loads_it(pooled):
    loads, unloads = count(pooled, "lmserve:model_loads_total", "emb"), count(pooled, "lmserve:model_unloads_total",
                                                                                "emb")
    first = post(pooled, "rag", "/v1/embeddings", {"model": "emb", "input": "a dog"}).json()["data"][0]["embedding"]
    assert 0 < loaded(pooled)["emb"] <= KEEP_S  # its clock runs from the response's end, not forever
    waited = wait_unloaded(pooled, "emb", timeout=KEEP_S + 60)
    assert waited > KEEP_S / 2  # at its keep-alive, not at once
    assert count(pooled, "lmserve:model_unloads_total", "emb") == unloads + 1
    assert listed(pooled, "rag")["emb"] is False  # still served, no longer loaded
    again = post(pooled, "rag", "/v1/embeddings", {"model": "emb", "input": "a dog"})
    assert again.status_code == 200, again.text
    assert np.allclose(again.json()["data"][0]["embedding"], first, atol=1e-6)  # the same model back
    assert count(pooled, "lmserve:model_loads_total", "emb") == loads + 1
    assert listed(pooled, "rag")["emb"] is True


def test_ollama_embed_keep_alive_holds_within_the_operators_bounds(pooled):
    rag, ops = as_ollama(pooled, "rag"), as_ollama(pooled, "ops")
    rag.embed(model="emb", input="a dog", keep_alive="10m")  # longer than --keep-alive: within --keep-alive-max
    assert 590 < loaded(pooled)["emb"] <= 600
    rag.embed(model="emb", input="a dog", keep_alive=-1)  # forever: cut to --keep-alive-max
    assert KEEP_MAX_S - 10 < loaded(pooled)["emb"] <= KEEP_MAX_S
    rag.embed(model="emb", input="a dog", keep_alive="1s")  # shorter, from a key that may not unload: the default
    assert KEEP_S / 2 < loaded(pooled)["emb"] <= KEEP_S
    r = post(pooled, "rag", "/api/embed", {"model": "emb", "input": "a dog", "keep_alive": 0})
    assert r.status_code == 403 and list(r.json()) == ["error"] and "keep_alive 0" in r.json()["error"], r.text
    unloads = count(pooled, "lmserve:model_unloads_total", "emb")
    assert ops.embed(model="emb", input="a dog", keep_alive=0).embeddings  # an admin's 0: answered, then unloaded
    assert wait_unloaded(pooled, "emb", timeout=60) < KEEP_S - 1  # at once, not at --keep-alive
    assert count(pooled, "lmserve:model_unloads_total", "emb") == unloads + 1
    legacy = post(pooled, "rag", "/api/embeddings", {"model": "emb", "prompt": "a dog", "keep_alive": "10m"})
    assert legacy.status_code == 200 and legacy.json()["embedding"], legacy.text  # loaded again, kept 10 minutes
    assert 590 < loaded(pooled)["emb"] <= 600


@pytest.mark.skipif(native_module() is None, reason="the gate needs the native CPU kernels")
def test_an_embedding_beside_a_decoding_chat_model_goes_first_and_the_metrics_say_so(pooled):
    """worker/cpu_gate.py through the server: each one-sentence embedding's step holds the gate, and the chat
    model's decode steps, running meanwhile, pause for some of them (the two models' counters). The counters are
    read once both models are loaded and the chat model decodes (an earlier test's keep-alive may have unloaded
    either, and a model loaded again counts from zero)."""
    body = {"model": "chat", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", pooled.url + "/v1/completions", json=body, headers=auth("chat-only"), timeout=300) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # decoding now
        assert post(pooled, "rag", "/v1/embeddings", {"model": "emb", "input": "a dog"}).status_code == 200
        holds = count(pooled, "lmserve:cpu_gate_holds_total", "emb")
        paused = count(pooled, "lmserve:cpu_gate_paused_seconds_total", "chat")
        for i in range(10):
            e = post(pooled, "rag", "/v1/embeddings", {"model": "emb", "input": f"the cat sat on the mat {i}"})
            assert e.status_code == 200, e.text
        assert count(pooled, "lmserve:num_requests_running", "chat") == 1  # still decoding after the embeddings
    assert count(pooled, "lmserve:cpu_gate_holds_total", "emb") == holds + 10
    assert count(pooled, "lmserve:cpu_gate_paused_seconds_total", "chat") > paused
    assert count(pooled, "lmserve:cpu_gate_holds_total", "chat") == 0  # a generative model never holds it
