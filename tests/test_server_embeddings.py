"""Embeddings over HTTP against a real `lmserve serve` of a tiny sentence-transformers checkpoint (mean pooling):
OpenAI's /v1/embeddings through the official `openai` client (float and base64), Ollama's /api/embed and
/api/embeddings through the official `ollama` client, the same vectors as sentence-transformers (1e-5), and bad
input answered with a 400 in each family's error shape without leaking a KV block."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import ollama
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.embedding_models import TEXTS, st_dir, st_reference  # noqa: F401  (fixtures)
from tests.server_util import running_server

NAME = "tiny-embed"
ATOL = 1e-5


@pytest.fixture(scope="module")
def reference(st_reference):
    return st_reference


@pytest.fixture(scope="module")
def server(st_dir):
    # a 16-token step budget: the 40-token input runs in chunks beside the others
    with running_server("--model", str(st_dir), "--dtype", "float32", "--served-model-name", NAME,
                        "--max-num-batched-tokens", "16") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _close(got, expected) -> None:
    torch.testing.assert_close(torch.as_tensor(np.asarray(got, dtype=np.float32)), expected, atol=ATOL, rtol=0)


def test_openai_client_float_and_base64_equal_sentence_transformers(client, reference):
    ids, expected = reference
    res = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in res.data] == list(range(len(TEXTS))) and res.model == NAME
    _close([d.embedding for d in res.data], expected)
    n = sum(map(len, ids))
    assert (res.usage.prompt_tokens, res.usage.total_tokens) == (n, n)
    b64 = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="base64")  # asked for: returned as is
    _close([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b64.data], expected)
    default = client.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64 and decodes it
    _close([d.embedding for d in default.data], expected)
    one = client.embeddings.create(model=NAME, input=TEXTS[1])
    _close([one.data[0].embedding], expected[1:2])


def test_token_id_inputs_dimensions_and_raw_base64(server, client, reference):
    ids, expected = reference
    _close([client.embeddings.create(model=NAME, input=ids[1]).data[0].embedding], expected[1:2])
    _close([d.embedding for d in client.embeddings.create(model=NAME, input=ids).data], expected)
    cut = client.embeddings.create(model=NAME, input=TEXTS, dimensions=16)
    _close([d.embedding for d in cut.data], F.normalize(expected[:, :16], dim=-1))
    body = httpx.post(server.url + "/v1/embeddings", json={"model": NAME, "input": TEXTS[0],
                                                           "encoding_format": "base64", "user": "u1"}).json()
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    _close([raw], expected[:1])


def test_ollama_client_embed_equals_v1_embeddings_and_legacy_is_raw(server, client, reference):
    _, expected = reference
    ol = ollama.Client(host=server.url)
    res = ol.embed(model=NAME, input=TEXTS, keep_alive="5m", options={"temperature": 0}, truncate=True)
    openai_vectors = [d.embedding for d in client.embeddings.create(model=NAME, input=TEXTS).data]
    assert np.array_equal(np.asarray(res.embeddings), np.asarray(openai_vectors))  # the same vectors
    _close(res.embeddings, expected)
    assert res.model == NAME and res.prompt_eval_count == client.embeddings.create(
        model=NAME, input=TEXTS).usage.prompt_tokens and res.total_duration > 0
    _close(ol.embed(model=NAME, input=TEXTS[2]).embeddings, expected[2:3])
    legacy = ol.embeddings(model=NAME, prompt=TEXTS[1]).embedding  # Ollama's legacy route: not normalised
    assert abs(float(np.linalg.norm(legacy)) - 1) > 1e-2
    _close([F.normalize(torch.tensor(legacy), dim=0).tolist()], expected[1:2])


def test_bad_input_is_a_400_in_each_familys_shape_and_leaks_no_block(server, client):
    long_ids = [5] * 257  # the context is 256
    for body in ({"model": NAME, "input": ""}, {"model": NAME, "input": []}, {"model": NAME, "input": 5},
                 {"model": NAME, "input": [1.5]}, {"model": NAME, "input": ["a", 1]}, {"model": NAME, "input": [[]]},
                 {"model": NAME, "input": [999]}, {"model": NAME, "input": long_ids},
                 {"model": NAME, "input": "w1", "encoding_format": "hex"},
                 {"model": NAME, "input": "w1", "dimensions": 0}, {"model": NAME, "input": "w1", "dimensions": 129},
                 {"input": "w1", "model": "other"}):
        r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=30)
        assert r.status_code in (400, 404), (body, r.text)
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}, r.text
    with pytest.raises(openai.BadRequestError, match="context"):
        client.embeddings.create(model=NAME, input=[long_ids])
    ol = ollama.Client(host=server.url)
    for body in ({"model": NAME, "input": ""}, {"model": NAME, "input": 3}, {"model": NAME, "input": [[1]]},
                 {"model": NAME, "input": "w1 " * 300, "truncate": False}, {"model": NAME, "prompt": 7}):
        path = "/api/embeddings" if "prompt" in body else "/api/embed"
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400 and isinstance(r.json()["error"], str), (body, r.text)
    with pytest.raises(ollama.ResponseError):
        ol.embed(model=NAME, input="w1 " * 300, truncate=False)
    # truncate (Ollama's default): cut to the context
    assert ol.embed(model=NAME, input="w1 " * 300).prompt_eval_count == 256
    server.wait_idle()  # every KV block back in the pool
    assert len(client.embeddings.create(model=NAME, input="w1 w2").data[0].embedding) == 128


def test_unknown_fields_are_ignored_and_named_as_for_chat(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": NAME, "input": "w1", "novel_field": 1})
    assert r.status_code == 200 and "novel_field" in r.headers.get("x-ignored-fields", "")


def test_vector_responses_carry_the_same_numbers_as_the_standard_encoder():
    """server/api/vectors.py renders with orjson: the same float64 values as starlette's JSONResponse (its text may
    differ, 1e-05 against 1e-5), and a NaN or an infinity refused as starlette's encoder refuses it."""
    import json

    from starlette.responses import JSONResponse

    from lmserve.server.api.vectors import VectorsResponse

    rng = np.random.default_rng(0)
    vec = [float(v) for v in rng.standard_normal(384).astype(np.float32) * 10.0 ** rng.integers(-8, 4, 384)]
    body = {"object": "list", "data": [{"index": 0, "embedding": vec}], "usage": {"prompt_tokens": 3}, "name": "é"}
    assert json.loads(VectorsResponse(body).body) == json.loads(JSONResponse(body).body) == body
    assert VectorsResponse(body).headers["content-type"] == "application/json"
    for bad in (float("nan"), float("inf"), -float("inf")):
        for body in ({"embedding": [1.0, bad]}, {"data": [{"probs": [bad]}]}, [[0.5, 1, bad]], {"score": bad}):
            with pytest.raises(ValueError, match="not JSON compliant"):
                JSONResponse(body)
            with pytest.raises(ValueError, match="not JSON compliant"):
                VectorsResponse(body)
    assert json.loads(VectorsResponse([[1e308, 1e308], [0.5, 1, "x"]]).body) == [[1e308, 1e308], [0.5, 1, "x"]]
