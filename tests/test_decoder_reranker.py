"""A decoder served as a reranker scored by a token pair (Qwen3-Reranker, vLLM's classifier_from_token): a tiny
random Qwen3ForCausalLM made by transformers, with `--classifier-from-token no,yes`; a pair's score is the softmax
over transformers' last-token logits of "no" and "yes", taken at "yes" — through LLM.embed and through a real server's
/v1/rerank and /v1/score."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from lmserve.engine.llm import LLM
from tests.server_util import free_port, running_server
from tests.tiny_models import VOCAB, build_hf

QUERY = "w10 w11 w12"
DOCS = ["w10 w11", "w40 w41 w42 w43 w44", "w12", "w7 w8 w9 w10 w11 w12 w13"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """The tiny Qwen3 with a word-level vocabulary that has "no" and "yes" (ids 3 and 4), no pair template: a pair
    is its two texts' tokens one after the other, as Qwen's tokenizer does."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path, model = build_hf("qwen3", tmp_path_factory.mktemp("reranker"))
    words = ["<pad>", "<s>", "</s>", "no", "yes"] + [f"w{i}" for i in range(VOCAB - 5)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path, model


def reference(model, ids: list[list[int]]) -> np.ndarray:
    """softmax over the last token's ("no", "yes") logits, at "yes"."""
    with torch.no_grad():
        return np.array([model(torch.tensor([x])).logits[0, -1, [3, 4]].softmax(-1)[1].item() for x in ids])


def test_token_pair_scores_equal_transformers(reranker):
    path, model = reranker
    # float32 as transformers' reference (CUDA's default dtype is bfloat16: 1.3e-2 apart, seen on an H200)
    llm = LLM(str(path), dtype="float32", classifier_from_token=("no", "yes"))
    assert llm.engine.front.tasks == ("generate", "score", "rerank", "classify")
    ids = [llm.tokenizer.encode_pair(QUERY, d) for d in DOCS]
    assert ids[0] == llm.tokenizer.encode(QUERY + " " + DOCS[0], add_special_tokens=False)
    got = np.array([o.outputs.embedding for o in llm.embed(ids, use_tqdm=False)])
    assert got.shape == (len(DOCS), 1)
    ref = reference(model, ids)
    assert np.abs(got[:, 0] - ref).max() < 1e-4
    assert ref.std() > 1e-3  # the documents score differently: the test tells them apart
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_a_token_outside_the_vocabulary_is_refused(reranker):
    with pytest.raises(Exception, match="not one token"):
        LLM(str(reranker[0]), classifier_from_token=("nope", "yes"))


def test_served_rerank_and_score_equal_transformers(reranker):
    path, model = reranker
    with running_server("--model", f"rr={path}", "--dtype", "float32", "--classifier-from-token", "no,yes",
                        start_timeout=600) as s:
        ref = reference(model, [_ids(QUERY, d) for d in DOCS])
        best = list(np.argsort(-ref))
        rerank = httpx.post(s.url + "/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS},
                            timeout=120).json()
        assert [r["index"] for r in rerank["results"]] == best
        assert np.allclose([r["relevance_score"] for r in rerank["results"]], ref[best], atol=1e-4)
        score = httpx.post(s.url + "/v1/score", json={"model": "rr", "text_1": QUERY, "text_2": DOCS},
                           timeout=120).json()
        assert np.allclose([d["score"] for d in score["data"]], ref, atol=1e-4)
        chat = httpx.post(s.url + "/v1/completions", json={"model": "rr", "prompt": "w1 w2", "max_tokens": 2},
                          timeout=120)
        assert chat.status_code == 200  # it still generates


def _ids(first: str, second: str) -> list[int]:
    """The word tokenizer's ids: "no" 3, "yes" 4, w<i> 5 + i."""
    return [5 + int(w[1:]) for w in f"{first} {second}".split()]


def test_a_flag_without_two_tokens_is_a_clean_error():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(free_port()), "--classifier-from-token", "yes"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "takes two tokens" in r.stderr and "Traceback" not in r.stderr
