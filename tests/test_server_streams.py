"""The one stream wrapper (server/streams.py encoded_stream) under every API family, through the real server.

A client that hangs up part-way frees its request (KV blocks back, the engine's running count to 0, one
client_disconnect abort), whichever family it spoke; and an engine step that fails part-way reaches each family's
official client as that family's in-stream error, after the events already sent. The failing server fails every
6th forward (LMSERVE_TEST_FAULT=every:6), so each request, sent one after another, streams 5 tokens and then fails.
"""

from __future__ import annotations

import json
import socket
import time

import anthropic
import huggingface_hub
import ollama
import openai
import pytest
from huggingface_hub.errors import TextGenerationError

from tests.server_util import MODEL, running_server

COUNT = "1, 2, 3, 4, 5, 6,"  # a raw prompt greedy decoding continues for as long as it is let
ASK = [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}]
FAILED = "engine step running this request failed"
LONG = 2000  # tokens: far more than a test waits for

# family -> (path, a streamed request that runs long, bytes that only a generated-text event carries)
GREEDY = {"temperature": 0}  # TGI's default already
STREAMS = {
    "completions": ("/v1/completions", {"prompt": COUNT, "max_tokens": LONG, "ignore_eos": True, **GREEDY},
                    b'"text": '),
    "chat": ("/v1/chat/completions", {"messages": ASK, "max_tokens": LONG, "ignore_eos": True, **GREEDY},
             b'"delta": {"content": '),
    "responses": ("/v1/responses", {"input": ASK, "max_output_tokens": LONG, **GREEDY}, b"response.output_text.delta"),
    "anthropic": ("/v1/messages", {"messages": ASK, "max_tokens": LONG, **GREEDY}, b"content_block_delta"),
    "ollama-chat": ("/api/chat", {"messages": ASK, "options": {"num_predict": LONG, **GREEDY}}, b'"done": false'),
    "ollama-generate": ("/api/generate", {"prompt": COUNT, "raw": True, "options": {"num_predict": LONG, **GREEDY}},
                        b'"done": false'),
    "tgi": ("/generate_stream", {"inputs": COUNT, "parameters": {"max_new_tokens": LONG}}, b'data:{"index"'),
}


def _hang_up_after(server, path: str, body: dict, marker: bytes) -> None:
    """Stream `body` on a raw socket, read until `marker` (generated text is flowing), check the request is running,
    then hang up."""
    raw = json.dumps({"model": MODEL, "stream": True, **body}).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    try:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        seen, deadline = b"", time.time() + 120
        while marker not in seen:
            assert time.time() < deadline, f"no generated text on {path}: {seen[-300:]!r}"
            chunk = s.recv(65536)
            assert chunk, f"{path} ended before any text: {seen[-300:]!r}"
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200"), seen[:200]
        assert server.metric("lmserve:num_requests_running") == 1
        assert server.metric("lmserve:kv_cache_free_blocks") < server.metric("lmserve:kv_cache_total_blocks")
    finally:
        s.close()


@pytest.mark.parametrize("family", list(STREAMS))
def test_a_client_that_leaves_mid_stream_frees_its_request(server, family):
    path, body, marker = STREAMS[family]
    server.wait_idle()
    before = server.metric("lmserve:request_aborts_total", 'reason="client_disconnect"')
    _hang_up_after(server, path, body, marker)
    server.wait_idle(timeout=30)  # every KV block back
    assert server.metric("lmserve:num_requests_running") == 0
    assert server.metric("lmserve:num_requests_in_flight") == 0
    assert server.metric("lmserve:request_aborts_total", 'reason="client_disconnect"') == before + 1


@pytest.fixture(scope="module")
def failing():
    with running_server(env={"LMSERVE_TEST_FAULT": "every:6"}) as s:
        s.failures = 0  # requests sent, each of which meets one failed forward
        yield s


def _fails(server) -> None:
    """After each failing request: one more failed step, every KV block back, nothing running."""
    server.failures += 1
    server.wait_idle()
    assert server.metric("lmserve:engine_step_failures_total") == server.failures
    assert server.metric("lmserve:num_requests_running") == 0


def test_openai_streams_fail_with_an_error_event_then_done(failing):
    c = openai.OpenAI(base_url=failing.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    text = []
    with pytest.raises(openai.APIError, match=FAILED) as e:
        for chunk in c.completions.create(model=MODEL, prompt=COUNT, max_tokens=LONG, temperature=0, stream=True):
            text.append(chunk.choices[0].text)
    assert "".join(text) and e.value.body["code"] == "engine_step_failed"
    _fails(failing)
    content = []
    with pytest.raises(openai.APIError, match=FAILED):
        for chunk in c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=LONG, temperature=0,
                                               stream=True):
            content.append(chunk.choices[0].delta.content or "")
    assert "".join(content)
    _fails(failing)


def test_openai_stream_bytes_end_with_the_error_then_done(failing):
    import httpx

    body = {"model": MODEL, "prompt": COUNT, "max_tokens": LONG, "temperature": 0, "stream": True}
    with httpx.stream("POST", failing.url + "/v1/completions", json=body, timeout=120) as r:
        events = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "engine_step_failed" and error["type"] == "internal_error", error
    assert all("choices" in json.loads(e.removeprefix("data: ")) for e in events[:-2]) and len(events) > 2
    _fails(failing)


def test_responses_stream_fails_with_error_then_response_failed(failing):
    c = openai.OpenAI(base_url=failing.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    events = list(c.responses.create(model=MODEL, input=ASK, max_output_tokens=LONG, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-2:] == ["error", "response.failed"] and "response.output_text.delta" in kinds
    assert events[-2].code == "engine_step_failed" and FAILED in events[-2].message
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    _fails(failing)


def test_anthropic_stream_fails_with_an_error_event(failing):
    c = anthropic.Anthropic(base_url=failing.url, api_key="unused", max_retries=0, timeout=120)
    text = []
    with pytest.raises(anthropic.APIStatusError, match=FAILED) as e:
        with c.messages.stream(model=MODEL, max_tokens=LONG, messages=ASK, extra_body={"temperature": 0}) as stream:
            for event in stream:
                if event.type == "content_block_delta":
                    text.append(event.delta.text)
    assert "".join(text) and e.value.body["error"]["type"] == "api_error"
    _fails(failing)


@pytest.mark.parametrize("route", ["chat", "generate"])
def test_ollama_stream_fails_with_an_error_line(failing, route):
    c = ollama.Client(host=failing.url, timeout=120)
    options = {"num_predict": LONG, "temperature": 0}
    parts = c.chat(model=MODEL, messages=ASK, options=options, stream=True) if route == "chat" else \
        c.generate(model=MODEL, prompt=COUNT, raw=True, options=options, stream=True)
    text = []
    with pytest.raises(ollama.ResponseError, match=FAILED):
        for part in parts:
            text.append(part.message.content if route == "chat" else part.response)
            assert not part.done
    assert "".join(text)
    _fails(failing)


def test_tgi_stream_fails_with_an_error_event(failing):
    c = huggingface_hub.InferenceClient(base_url=failing.url, timeout=120)
    tokens = []
    with pytest.raises(TextGenerationError, match=FAILED):
        for event in c.text_generation(COUNT, max_new_tokens=LONG, stream=True, details=True):
            tokens.append(event.token.text)
            assert event.details is None
    assert len(tokens) == 5  # every:6 - five forwards' tokens, then the error
    _fails(failing)
