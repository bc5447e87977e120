"""Beam search (beam_search.py): `LLM.beam_search` equals transformers' `generate(num_beams=...)` token for
token on a tiny random float32 Llama; beams share their prompt's KV blocks through the prefix cache and leave no
block behind; `/v1/completions` with `use_beam_search` through the official openai client, and its 400s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmserve import LLM, BeamSearchParams
from tests.conftest import write_tiny_llama

EOS = 59  # a token the tiny model's beams often pick: some beams end with EOS, others at max_tokens
PROMPTS = [[1, 5 + i, 17 + 3 * i, 40 + i, 9] for i in range(4)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("beam") / "llama"
    write_tiny_llama(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": EOS}))
    return path


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(str(tiny), dtype="float32", block_size=4, num_blocks=256, num_threads=2)


def hf_beams(model, eos: list[int], width: int, length_penalty: float, early_stopping) -> list[list[list[int]]]:
    """transformers' beams per prompt, best first, each cut after its EOS (the rest is padding)."""
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPTS), num_beams=width, num_return_sequences=width, do_sample=False,
                             max_new_tokens=MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping,
                             eos_token_id=eos, pad_token_id=0)
    rows = [row[len(PROMPTS[0]):] for row in out.tolist()]
    rows = [row[:next((j + 1 for j, t in enumerate(row) if t in eos), len(row))] for row in rows]
    return [rows[i * width:(i + 1) * width] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("width,length_penalty,early_stopping", [(2, 1.0, False), (4, 0.5, True), (4, 2.0, "never")])
def test_beams_equal_transformers_num_beams(tiny, llm, width, length_penalty, early_stopping):
    """Every returned beam of 4 prompts, in order, is transformers' (its default heuristic, True and "never")."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    eos = sorted(llm.engine.front.eos_token_ids)
    assert EOS in eos
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    ref = hf_beams(model, eos, width, length_penalty, early_stopping)
    assert [[s.tokens[len(p):] for s in o.sequences] for p, o in zip(PROMPTS, outs)] == ref
    seqs = [s for o in outs for s in o.sequences]
    assert {s.finish_reason for s in seqs} == {"stop", "length"}  # both ways a beam ends are exercised
    for p, s in zip(PROMPTS, (o.sequences[0] for o in outs)):
        assert s.tokens[:len(p)] == p and s.text == llm.tokenizer.decode(s.tokens)
        assert s.score == pytest.approx(s.cum_logprob / (len(s.tokens) - len(p)) ** length_penalty)
    assert all(o.sequences == sorted(o.sequences, key=lambda s: -s.score) for o in outs)


def test_beams_share_prompt_blocks_and_free_them(llm):
    """Beams of a long prompt hold its blocks once (prefix-cache hits), far below width x whole sequence, and the
    pool is whole again afterwards."""
    eng, width = llm.engine, 4
    prompt = [1] + [3 + (7 * i) % 200 for i in range(39)]  # 40 tokens: 10 blocks of 4
    held, execute = [], eng.executor.execute

    def counting(out):
        held.append(eng.num_blocks - eng.kv.num_free_blocks)
        return execute(out)

    eng.executor.execute = counting
    hits = eng.kv.prefix_hits
    try:
        (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        del eng.executor.execute
    assert len(out.sequences) == width and all(len(s.tokens) == len(prompt) + MAX_TOKENS for s in out.sequences)
    unshared = width * eng.kv.blocks_needed(len(prompt) + MAX_TOKENS)  # 4 x 12 blocks
    assert max(held) <= 10 + 3 * width < unshared / 2
    # every beam request after the first step finds at least the prompt's 9 full blocks cached
    assert eng.kv.prefix_hits - hits >= (MAX_TOKENS - 1) * width * 36
    assert not eng.has_unfinished() and eng.kv.req_blocks == {} and eng.kv.num_free_blocks == eng.num_blocks


def test_beam_search_params_refuse_bad_values():
    for bad, words in [(dict(beam_width=0), "beam_width"), (dict(temperature=0.7), "temperature must be 0"),
                       (dict(early_stopping="sometimes"), "early_stopping"), (dict(max_tokens=0), "max_tokens")]:
        with pytest.raises(ValueError, match=words):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})


@pytest.fixture(scope="module")
def server(tiny):
    from tests.server_util import running_server

    with running_server("--model", f"tiny={tiny}", "--dtype", "float32", "--block-size", "4") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_completions_use_beam_search_through_the_openai_client(client, llm):
    """best_of beams per prompt, the best n returned in order: the offline beams, the EOS not in the text."""
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=0.5, early_stopping=True)
    offline = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=MAX_TOKENS, n=2, extra_body={
        "use_beam_search": True, "best_of": 4, "length_penalty": 0.5, "early_stopping": True})
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    expected = [s for o in offline for s in o.sequences[:2]]
    for c, (p, s) in zip(r.choices, [(p, s) for p, o in zip(PROMPTS, offline) for s in o.sequences[:2]]):
        out = s.tokens[len(p):]
        assert c.text == llm.tokenizer.decode(out[:-1] if s.finish_reason == "stop" else out)
        assert c.finish_reason == s.finish_reason
    assert r.usage.completion_tokens == sum(len(s.tokens) - len(PROMPTS[0]) for s in expected)
    assert r.usage.prompt_tokens == 2 * len(PROMPTS[0])
    # n alone sets the width; the server still answers plain requests after beams
    assert len(client.completions.create(model="tiny", prompt="w5 w6", max_tokens=3, n=3,
                                         extra_body={"use_beam_search": True}).choices) == 3
    assert client.completions.create(model="tiny", prompt="w5 w6", max_tokens=3).choices[0].finish_reason


@pytest.mark.parametrize("fields,param", [
    ({"n": 3, "best_of": 2}, "n"), ({"best_of": 0}, "best_of"), ({"temperature": 0.7}, "temperature"),
    ({"stream": True}, "stream"), ({"logprobs": 0}, "logprobs"), ({"top_p": 0.5}, "top_p"),
    ({"early_stopping": "sometimes"}, "early_stopping"), ({"best_of": 17}, "best_of"),
    ({"prompt": ["w5"] * 64, "best_of": 16}, "best_of")])  # 1024 beams: more than the server runs and queues
def test_beam_search_refuses_bad_values_with_openai_errors(server, fields, param):
    import httpx

    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 3, "use_beam_search": True, **fields}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "") + err["message"]


def test_beam_fields_without_use_beam_search_are_refused(server):
    import httpx

    for fields, param in (({"best_of": 2}, "best_of"), ({"length_penalty": 2.0}, "length_penalty")):
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "w5", **fields}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_chat_refuses_use_beam_search_rather_than_ignoring_it(server):
    import httpx

    body = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "use_beam_search": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"


def test_a_client_that_leaves_mid_search_aborts_it_and_frees_every_block(server, client):
    """The disconnect aborts the step running then (counted once), no later step starts, the pool is whole again."""
    import httpx

    before = server.metric("lmserve:request_aborts_total", 'reason="client_disconnect"')
    body = {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 400, "ignore_eos": True, "use_beam_search": True,
            "best_of": 8}  # 400 steps of 8 beams: seconds, well past the client's patience
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    server.wait_idle()
    assert server.metric("lmserve:request_aborts_total", 'reason="client_disconnect"') == before + 1
    assert server.metric("lmserve:num_requests_running") == 0
    assert len(client.completions.create(model="tiny", prompt="w5", max_tokens=2, n=2,
                                         extra_body={"use_beam_search": True}).choices) == 2
