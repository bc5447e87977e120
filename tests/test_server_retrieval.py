"""A retrieval server, black-box: the real all-MiniLM-L6-v2 as the embedder, a tiny BERT cross-encoder as the
reranker, a tiny 3-label BERT classifier and the embedded chat model, side by side in one `lmserve serve`, asked by the official clients
(openai, LangChain's OpenAIEmbeddings, ollama) and by httpx in Jina's, Cohere's, TEI's and vLLM's shapes; answers
against sentence-transformers; bad input a 400 in each API's own error shape (OpenAI's on /v1/*, /rerank, /v2/rerank
and /classify, Ollama's on /api/embed, TEI's on /embed), checked by shape."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.encoder_models import SENTENCES, build_encoder, minilm_dir
from tests.server_util import running_server

QUERY = "the cat sat on the mat"
DOCS = ["a dog", "the cat sat on the mat", "it is what it is", "an apple a day keeps the w40 away"]
MAX_DOCS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval")
    return {"minilm": minilm_dir(), "ce": build_encoder(root, "bert", num_labels=1, pooling=None),
            "cls": build_encoder(root, "bert", num_labels=3, pooling=None)}


@pytest.fixture(scope="module")
def server(models, smol_path):
    args = [a for name, path in {**models, "chat": smol_path}.items() for a in ("--model", f"{name}={path}")]
    with running_server(*args, "--max-rerank-documents", str(MAX_DOCS), start_timeout=600) as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def st_encode(models, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(models["minilm"]), device="cpu").encode(texts)


def ce_predict(models, pairs: list[tuple[str, str]]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(models["ce"]), device="cpu").predict(pairs)


def test_the_chat_model_answers_beside_the_encoders(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].message.content
    assert len(client.embeddings.create(model="minilm", input="Hi").data[0].embedding) == 384
    r = post(server, "/v1/rerank", {"model": "chat", "query": "a", "documents": ["b"]})
    assert r.status_code == 400 and "its tasks: generate, embed" in r.json()["error"]["message"]


def test_openai_langchain_ollama_and_tei_embeddings_equal_sentence_transformers(server, models):
    import ollama
    import openai
    from langchain_openai import OpenAIEmbeddings

    ref = st_encode(models, SENTENCES)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    got = {"openai": [d.embedding for d in client.embeddings.create(model="minilm", input=SENTENCES).data]}
    lc = OpenAIEmbeddings(model="minilm", base_url=server.url + "/v1", api_key="x", check_embedding_ctx_length=False)
    got["langchain"] = lc.embed_documents(SENTENCES)
    got["ollama"] = ollama.Client(host=server.url).embed(model="minilm", input=SENTENCES).embeddings
    got["tei"] = post(server, "/embed", {"model": "minilm", "inputs": SENTENCES}).json()
    for name, vectors in got.items():
        cos = (np.array(vectors) * ref).sum(1) / np.linalg.norm(ref, axis=1)
        assert cos.min() > 1 - 1e-5, name


def test_jina_and_cohere_rerank_equal_the_cross_encoder(server, models):
    ref = ce_predict(models, [(QUERY, d) for d in DOCS])
    best = list(np.argsort(-ref))
    jina = post(server, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert [r["index"] for r in jina["results"]] == best[:2]
    assert [r["document"]["text"] for r in jina["results"]] == [DOCS[i] for i in best[:2]]
    assert np.allclose([r["relevance_score"] for r in jina["results"]], ref[best[:2]], atol=1e-4)
    cohere = post(server, "/rerank", {"model": "ce", "query": QUERY, "documents": [{"text": d} for d in DOCS],
                                      "return_documents": False}).json()
    assert [r["index"] for r in cohere["results"]] == best and "document" not in cohere["results"][0]
    tei = post(server, "/rerank", {"model": "ce", "query": QUERY, "texts": DOCS, "raw_scores": True}).json()
    assert [r["index"] for r in tei] == best
    assert np.allclose([r["score"] for r in tei], np.log(ref[best] / (1 - ref[best])), atol=1e-3)


def test_langchain_cohere_rerank_and_cohere_v2_client_equal_the_cross_encoder(server, models):
    """LangChain's CohereRerank (langchain-cohere) and cohere.ClientV2 under it, pointed at this server by base_url:
    they post Cohere v2's body to /v2/rerank and read its answer."""
    import cohere
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    ref = ce_predict(models, [(QUERY, d) for d in DOCS])
    best = list(np.argsort(-ref))
    reranker = CohereRerank(model="ce", base_url=server.url, cohere_api_key="x", top_n=2)
    got = reranker.compress_documents([Document(page_content=d, metadata={"i": i}) for i, d in enumerate(DOCS)], QUERY)
    assert [d.metadata["i"] for d in got] == best[:2]
    assert np.allclose([d.metadata["relevance_score"] for d in got], ref[best[:2]], atol=1e-4)
    client = cohere.ClientV2(api_key="x", base_url=server.url)
    answer = client.rerank(model="ce", query=QUERY, documents=DOCS)
    assert [r.index for r in answer.results] == best
    cut = client.rerank(model="ce", query=QUERY, documents=["the cat sat on the mat w5 w6 w7"], max_tokens_per_doc=6)
    assert np.isclose(cut.results[0].relevance_score, ce_predict(models, [(QUERY, DOCS[1])])[0], atol=1e-4)


def test_score_uses_the_head_for_a_cross_encoder_and_cosine_for_an_embedder(server, models):
    one_to_many = post(server, "/v1/score", {"model": "ce", "text_1": QUERY, "text_2": DOCS}).json()
    assert np.allclose([d["score"] for d in one_to_many["data"]], ce_predict(models, [(QUERY, d) for d in DOCS]),
                       atol=1e-4)
    pairs = post(server, "/v1/score", {"model": "minilm", "text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    ref = st_encode(models, DOCS)
    assert np.allclose([d["score"] for d in pairs["data"]], [ref[0] @ ref[2], ref[1] @ ref[3]], atol=1e-5)
    rerank = post(server, "/v1/rerank", {"model": "minilm", "query": QUERY, "documents": DOCS}).json()
    assert rerank["results"][0]["index"] == 1  # the identical text first (cosine 1)


def test_classify_gives_each_inputs_label_probabilities(server):
    got = post(server, "/classify", {"model": "cls", "input": SENTENCES[:2]}).json()
    assert [d["num_classes"] for d in got["data"]] == [3, 3]
    for d in got["data"]:
        assert abs(sum(d["probs"]) - 1) < 1e-5 and d["label"] == f"LABEL_{int(np.argmax(d['probs']))}"


@pytest.mark.parametrize("path,body,says", [
    ("/v1/embeddings", {"model": "ce", "input": "a dog"}, "its tasks: score, rerank, classify"),
    ("/classify", {"model": "minilm", "input": "a dog"}, "its tasks: embed, score, rerank"),
    ("/v1/rerank", {"model": "cls", "query": "a", "documents": ["b"]}, "its tasks: classify"),
    ("/v1/completions", {"model": "minilm", "prompt": "a dog", "max_tokens": 2}, "does not generate"),
    ("/v1/rerank", {"model": "ce", "query": "a", "documents": []}, "must not be empty"),
    ("/v1/rerank", {"model": "ce", "query": "a", "documents": ["b", ""]}, "non-empty"),
    ("/v1/rerank", {"model": "ce", "query": "a", "documents": ["b"] * (MAX_DOCS + 1)}, "--max-rerank-documents"),
    ("/v1/score", {"model": "ce", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "equally long"),
    ("/v1/rerank", {"model": "ce", "query": "a", "documents": ["w1 " * 200]}, "past the model's window"),
    ("/v1/embeddings", {"model": "minilm", "input": ""}, "non-empty"),
])
def test_bad_input_is_a_400_in_openais_shape(server, path, body, says):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


@pytest.mark.parametrize("body,names", [
    ({"model": "minilm", "input": []}, "input"),
    ({"model": "minilm", "input": ""}, "input"),
    ({"model": "minilm", "input": ["a dog", ""]}, "input"),
    ({"model": "ce", "input": "a dog"}, "tasks"),  # a cross-encoder does not embed
    ({"model": "cls", "input": "a dog"}, "tasks"),  # nor does a classifier
])
def test_ollama_embed_errors_are_a_400_in_ollamas_body(server, body, names):
    import ollama

    r = post(server, "/api/embed", body)
    assert r.status_code == 400, r.text
    assert list(r.json()) == ["error"] and isinstance(r.json()["error"], str) and names in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:  # the official client reads it as Ollama's error
        ollama.Client(host=server.url).embed(**body)
    assert e.value.status_code == 400 and e.value.error == r.json()["error"]


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank", "/rerank"])
@pytest.mark.parametrize("model,docs,param", [
    ("ce", ["b"] * (MAX_DOCS + 1), "documents"),  # past --max-rerank-documents
    ("chat", ["b"], "model"),  # a model that only embeds (a decoder's pooled states) does not rerank
    ("cls", ["b"], "model"),  # nor does a classifier
])
def test_rerank_errors_are_a_400_in_the_rerank_routes_body(server, path, model, docs, param):
    """Jina's and Cohere's routes answer errors in OpenAI's body (as vLLM's rerank routes do)."""
    r = post(server, path, {"model": model, "query": "a", "documents": docs})
    assert r.status_code == 400, r.text
    assert list(r.json()) == ["error"]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and isinstance(err["message"], str)


def test_cohere_v2_client_reads_a_rerank_refusal_as_a_bad_request(server):
    import cohere

    client = cohere.ClientV2(api_key="x", base_url=server.url)
    for model, docs in (("ce", ["b"] * (MAX_DOCS + 1)), ("chat", ["b"])):
        with pytest.raises(cohere.BadRequestError) as e:
            client.rerank(model=model, query="a", documents=docs)
        assert e.value.status_code == 400 and isinstance(e.value.body["error"]["message"], str)


def test_tei_errors_and_truncation(server):
    r = post(server, "/embed", {"model": "ce", "inputs": "a dog"})
    assert r.status_code == 400 and r.json()["error_type"] == "validation"
    long = "the cat " * 200  # past MiniLM's 256-token window
    assert post(server, "/embed", {"model": "minilm", "inputs": long}).status_code == 400
    cut = post(server, "/embed", {"model": "minilm", "inputs": long, "truncate": True}).json()[0]
    again = post(server, "/v1/embeddings", {"model": "minilm", "input": long, "truncate_prompt_tokens": 256}).json()
    assert np.allclose(cut, again["data"][0]["embedding"], atol=1e-6)
    ok = post(server, "/v1/rerank", {"model": "ce", "query": "a", "documents": ["w1 " * 200],
                                     "truncate_prompt_tokens": 64})
    assert ok.status_code == 200, ok.text


def test_more_texts_than_the_engine_can_queue_is_a_400_not_a_503(models):
    with running_server("--model", str(models["ce"]), "--max-num-seqs", "2", "--max-queued-requests", "3") as s:
        r = post(s, "/v1/rerank", {"query": "a", "documents": ["b"] * 6})
        assert r.status_code == 400 and "--max-queued-requests" in r.json()["error"]["message"]
        ok = post(s, "/v1/rerank", {"query": "a", "documents": ["b", "a dog", "c", "d", "e"]})
        assert ok.status_code == 200 and len(ok.json()["results"]) == 5
        s.wait_idle()
