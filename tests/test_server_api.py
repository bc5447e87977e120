"""Black-box API tests: the real server process, the official `openai` client, httpx for TGI routes."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from lmserve import SamplingParams
from tests.server_util import MODEL


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].object == "model"
    assert models[0].weight_format == "gguf"  # --quantization auto (the default) kept the GGUF's blocks


def test_greedy_completion_equals_offline(client, offline_llm):
    prompt = "The three primary colours are"
    http = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    offline = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert http.choices[0].text == offline[0].outputs[0].text
    assert http.object == "text_completion" and http.id.startswith("cmpl-")
    assert http.usage.prompt_tokens == len(offline[0].prompt_token_ids)
    assert http.usage.completion_tokens == 24 and http.choices[0].finish_reason == "length"


def test_greedy_chat_equals_offline(client, offline_llm):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]
    http = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    offline = offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert http.choices[0].message.content == offline[0].outputs[0].text
    assert http.choices[0].message.role == "assistant" and http.object == "chat.completion"
    assert http.choices[0].finish_reason == offline[0].outputs[0].finish_reason


def test_prompt_forms_n_and_usage(client):
    for prompt, count in (("Hi", 1), (["Hi", "Bye"], 2), ([504, 3458, 282], 1), ([[504, 3458], [1123, 30]], 2)):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, n=2)
        assert len(r.choices) == 2 * count
        assert sorted(c.index for c in r.choices) == list(range(2 * count))
        assert r.usage.completion_tokens == sum(1 for _ in r.choices) * 3


def test_sampling_parameters_are_honoured(client):
    base = dict(model=MODEL, prompt="Write a list of fruits:", max_tokens=12)
    a = client.completions.create(**base, temperature=0.9, seed=11)
    b = client.completions.create(**base, temperature=0.9, seed=11)
    assert a.choices[0].text == b.choices[0].text  # same seed, same text
    greedy = client.completions.create(**base, temperature=0).choices[0].text
    stop_at = greedy.strip()[:2]
    stopped = client.completions.create(**base, temperature=0, stop=[stop_at])
    assert stop_at not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    # logit_bias forcing one token
    forced = client.completions.create(model=MODEL, prompt="Write a list of fruits:", temperature=0, max_tokens=3,
                                       logit_bias={"42": 100}, logprobs=0)
    piece = client.post("/../detokenize", cast_to=object, body={"tokens": [42]})["prompt"]
    assert forced.choices[0].logprobs.tokens == [piece] * 3
    penalised = client.completions.create(**base, temperature=0, frequency_penalty=2.0, presence_penalty=2.0,
                                          user="tester", extra_body={"repetition_penalty": 1.3, "top_k": 5,
                                                                     "min_p": 0.05, "min_tokens": 4,
                                                                     "ignore_eos": True, "stop_token_ids": [2]})
    assert penalised.usage.completion_tokens == 12


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert abs(max(lp.top_logprobs[0].values()) - lp.token_logprobs[0]) < 1e-5  # greedy picks the top one
    assert "".join(lp.tokens) == r.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "The capital of France is" + r.choices[0].text
    chunks = [c.choices[0] for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=1, stream=True)]
    assert sum((c.logprobs.tokens for c in chunks), []) == lp.tokens
    assert sum((c.logprobs.text_offset for c in chunks), []) == lp.text_offset  # offsets run across chunks


def test_chat_stop_and_seed(client):
    base = dict(model=MODEL, messages=[{"role": "user", "content": "List three animals."}], max_tokens=16)
    greedy = client.chat.completions.create(**base, temperature=0).choices[0].message.content
    word = greedy.split()[1]
    stopped = client.chat.completions.create(**base, temperature=0, stop=word)
    assert stopped.choices[0].finish_reason == "stop" and word not in stopped.choices[0].message.content
    a, b = (client.chat.completions.create(**base, temperature=1.0, seed=7, n=2) for _ in range(2))
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_chat_logprobs_parts_and_max_completion_tokens(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Say "},
                                                            {"type": "text", "text": "hello"}]}],
        max_completion_tokens=4, temperature=0, logprobs=True, top_logprobs=2, n=2, seed=1)
    assert len(r.choices) == 2 and r.usage.completion_tokens <= 8
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens // 2 or len(content) <= 4
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)


def test_streaming_completion_and_usage(client, offline_llm):
    prompt = "In a small village"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16),
                                        use_tqdm=False)[0].outputs[0].text
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"


def test_streaming_chat_role_first(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + \
        chunks[-1].usage.completion_tokens


def test_async_client_streaming(server):
    async def run():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        stream = await ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count: 1, 2,"}],
                                                  max_tokens=8, temperature=0, stream=True)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        full = await ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count: 1, 2,"}],
                                                max_tokens=8, temperature=0)
        await ac.close()
        return "".join(parts), full.choices[0].message.content

    streamed, whole = asyncio.run(run())
    assert streamed == whole and streamed


def test_tgi_generate_and_stream(server):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6, "details": True}}
    r = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert r["details"]["generated_tokens"] == 6 and r["details"]["finish_reason"] == "length"
    assert "".join(t["text"] for t in r["details"]["tokens"]) == r["generated_text"]
    full = httpx.post(server.url + "/generate", json={**body, "parameters": {**body["parameters"],
                                                                              "return_full_text": True}}).json()
    assert full["generated_text"] == body["inputs"] + r["generated_text"]
    events = []
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    assert len(events) == 6 and events[-1]["generated_text"] == r["generated_text"]
    assert "".join(e["token"]["text"] for e in events) == r["generated_text"]
    sampled = httpx.post(server.url + "/generate", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": 4, "do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 5,
        "repetition_penalty": 1.1, "stop": ["\n"], "details": True}}).json()
    assert isinstance(sampled["generated_text"], str) and sampled["details"]["seed"] == 5
    unseeded = httpx.post(server.url + "/generate", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": 2, "do_sample": True, "details": True}}).json()
    assert isinstance(unseeded["details"]["seed"], int)  # TGI reports the seed a sampled request drew from


def test_tgi_semantics_stop_sequence_greedy_and_compat_route(server):
    greedy = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8, "details": True}}
    first = httpx.post(server.url + "/generate", json=greedy, timeout=60).json()
    assert first["details"]["seed"] is None  # do_sample false: greedy, as with temperature 0
    assert first == httpx.post(server.url + "/generate", json=greedy, timeout=60).json()
    word = first["details"]["tokens"][1]["text"]
    body = {"inputs": greedy["inputs"], "parameters": {"max_new_tokens": 8, "stop": [word], "details": True}}
    r = httpx.post(server.url + "/generate", json=body).json()
    assert r["details"]["finish_reason"] == "stop_sequence" and r["generated_text"].endswith(word)  # TGI keeps it
    events = []
    with httpx.stream("POST", server.url + "/", json={**body, "stream": True}) as s:
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert events[-1]["generated_text"] == r["generated_text"]
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert all(isinstance(e["token"]["logprob"], float) for e in events)
    assert httpx.post(server.url + "/", json=body).json() == r
    info = httpx.get(server.url + "/info").json()
    assert info["model_id"] == MODEL and info["max_total_tokens"] == 8192


def test_health_tokenize_detokenize_version(server):
    assert httpx.get(server.url + "/health").status_code == 200
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) == 2 and tok["max_model_len"] == 8192
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json() == \
        {"prompt": "hello world", "content": "hello world"}
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 5
    assert httpx.get(server.url + "/version").json()["version"]
