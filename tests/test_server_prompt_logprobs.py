"""Prompt logprobs through the real server against transformers in float32.

OpenAI's echo + logprobs (what lm-evaluation-harness's local-completions sends to score text),
max_tokens 0 with echo, vLLM's `prompt_logprobs` extra, streaming, and TGI's decoder_input_details.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch

from tests.conftest import hf_from_gguf
from tests.server_util import MODEL

PROMPT = "The capital of France is Paris, and the capital of Italy is"
K = 3
TOL = 1e-4


@dataclass
class Reference:
    """log p(ids[i] | ids[:i]) from transformers, with the top-K and the token's rank (entry 0 unused)."""

    ids: list[int]
    logprob: list[float]
    top: list[list[tuple[int, float]]]
    rank: list[int]
    pieces: list[str]  # each prompt token's text


@pytest.fixture(scope="module")
def server():
    """The float path (--quantization none; the default keeps the GGUF blocks): compared with transformers' float32
    within 1e-4 (float32 pinned: --dtype auto picks bf16 on an AMX CPU where it measures it faster)."""
    from tests.server_util import running_server

    with running_server("--quantization", "none", "--dtype", "float32") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(smol_path):
    from lmserve.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smol_path)


@pytest.fixture(scope="module")
def ref(smol_path, tok) -> Reference:
    model = hf_from_gguf(smol_path)
    ids = tok.encode_prompt(PROMPT)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len(ids), vocab]
    lp, top, rank = [0.0], [[]], [0]
    for i in range(1, len(ids)):
        row = logp[i - 1]
        lp.append(row[ids[i]].item())
        values, top_ids = row.topk(K)
        top.append(list(zip(top_ids.tolist(), values.tolist())))
        rank.append(int((row > row[ids[i]]).sum()) + 1)
    return Reference(ids, lp, top, rank, [tok.id_to_piece(t) for t in ids])


def _close(a: float | None, b: float) -> bool:
    return a is not None and abs(a - b) <= TOL


def _check_legacy_prompt_part(lp: dict, ref: Reference, tok) -> None:
    """The first len(prompt) positions of a legacy logprobs object are the prompt's, against the reference."""
    n = len(ref.ids)
    assert lp["tokens"][:n] == ref.pieces and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    offsets = [sum(len(p) for p in ref.pieces[:i]) for i in range(n)]
    assert lp["text_offset"][:n] == offsets
    for i in range(1, n):
        assert _close(lp["token_logprobs"][i], ref.logprob[i]), (i, lp["token_logprobs"][i], ref.logprob[i])
        k = len(lp["top_logprobs"][i])
        expected = {tok.id_to_piece(t): v for t, v in ref.top[i][:k]}
        assert k >= 1 and lp["top_logprobs"][i].keys() == expected.keys()
        assert all(_close(lp["top_logprobs"][i][p], v) for p, v in expected.items())


def _completion(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_max_tokens_zero_returns_the_prompt_only(client):
    """No logprobs asked: this part needs no prompt logprobs from the engine."""
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=0, echo=True)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [PROMPT, "Hello"]
    assert all(c.finish_reason == "length" and c.logprobs is None for c in r.choices)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert chunks[-1].usage.completion_tokens == 0


def test_echo_logprobs_cover_the_prompt_then_the_output(client, server, ref, tok):
    n = len(ref.ids)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=K)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=K, echo=True)
    choice = r.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs.model_dump()
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 3
    _check_legacy_prompt_part(lp, ref, tok)
    assert lp["tokens"][n:] == plain.choices[0].logprobs.tokens
    assert all(_close(a, b) for a, b in zip(lp["token_logprobs"][n:], plain.choices[0].logprobs.token_logprobs))
    assert lp["text_offset"][n] == len(PROMPT)  # generated offsets count from the start of the echoed text
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 3


def test_lm_eval_harness_scoring_request(server, ref):
    """local-completions' loglikelihood payload: token-id prompt, max_tokens 1, echo, logprobs 1; it reads
    token_logprobs[ctxlen:-1] and checks greediness against max(top_logprobs)."""
    ctxlen = 5
    body = _completion(server, prompt=ref.ids, max_tokens=1, logprobs=1, echo=True, seed=1234)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ref.ids) + 1
    scored = lp["token_logprobs"][ctxlen:-1]
    assert abs(sum(scored) - sum(ref.logprob[ctxlen:])) <= TOL * len(scored)
    greedy = all(t == max(top.values()) for t, top in zip(scored, lp["top_logprobs"][ctxlen:-1]))
    assert greedy == all(r == 1 for r in ref.rank[ctxlen:])
    # max_tokens 0 gives the same prompt part without the generated token
    zero = _completion(server, prompt=ref.ids, max_tokens=0, logprobs=1, echo=True)["choices"][0]
    assert zero["logprobs"]["tokens"] == lp["tokens"][:-1] and zero["finish_reason"] == "length"
    assert all(_close(a, b) for a, b in zip(zero["logprobs"]["token_logprobs"][1:], lp["token_logprobs"][1:-1]))


def test_vllm_prompt_logprobs_extra(server, ref, tok):
    body = _completion(server, prompt=PROMPT, max_tokens=2, prompt_logprobs=K, n=2)
    for choice in body["choices"]:
        assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ref.ids) and plp[0] is None
        for i in range(1, len(ref.ids)):
            entry = plp[i]
            mine = entry[str(ref.ids[i])]
            assert _close(mine["logprob"], ref.logprob[i]) and mine["rank"] == ref.rank[i]
            assert mine["decoded_token"] == ref.pieces[i]
            top_ids = [t for t, _ in ref.top[i]]
            assert set(entry) == {str(t) for t in top_ids} | {str(ref.ids[i])}
            for rank, (t, v) in enumerate(ref.top[i], 1):
                assert _close(entry[str(t)]["logprob"], v) and entry[str(t)]["rank"] == rank
                assert entry[str(t)]["decoded_token"] == tok.id_to_piece(t)
    # prompt_logprobs 0: the prompt's own token only
    zero = _completion(server, prompt=PROMPT, max_tokens=1, prompt_logprobs=0)["choices"][0]["prompt_logprobs"]
    assert all(list(e) == [str(t)] for e, t in zip(zero[1:], ref.ids[1:]))


def test_streaming_sends_prompt_logprobs_in_the_first_chunk(server, ref, tok):
    n = len(ref.ids)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": K, "echo": True,
            "prompt_logprobs": K, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks]
    first = choices[0]
    assert first["text"].startswith(PROMPT) and len(first["prompt_logprobs"]) == n
    assert all("prompt_logprobs" not in c for c in choices[1:])
    joined = {k: sum((c["logprobs"][k] for c in choices), []) for k in first["logprobs"]}
    _check_legacy_prompt_part(joined, ref, tok)
    whole = _completion(server, **{k: v for k, v in body.items() if k not in ("stream", "model")})["choices"][0]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert joined["tokens"] == whole["logprobs"]["tokens"] and joined["text_offset"] == whole["logprobs"]["text_offset"]


def test_tgi_decoder_input_details(server, ref):
    params = {"max_new_tokens": 2, "details": True, "decoder_input_details": True}
    r = httpx.post(server.url + "/generate", json={"inputs": PROMPT, "parameters": params}, timeout=120).json()
    prefill = r["details"]["prefill"]
    assert [t["id"] for t in prefill] == ref.ids and [t["text"] for t in prefill] == ref.pieces
    assert prefill[0]["logprob"] is None
    assert all(_close(t["logprob"], v) for t, v in zip(prefill[1:], ref.logprob[1:]))
    without = httpx.post(server.url + "/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 2, "details": True}}, timeout=120).json()
    assert without["details"]["prefill"] == [] and without["generated_text"] == r["generated_text"]
