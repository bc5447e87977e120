"""Bad input gets the right 4xx and error shape and never harms the server; auth; backpressure; SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.server_util import MODEL, running_server

M = MODEL
C, CH = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def comp(**kw):
    return {"model": M, "prompt": "hello", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": M, "messages": USER, "max_tokens": 2, **kw}


# (id, method, path, body (dict -> JSON, str/bytes -> raw), status, match in message)
CASES = [
    ("invalid-json", "POST", C, "{", 400, "not valid JSON"),
    ("json-array", "POST", C, "[]", 400, "JSON object"),
    ("nan", "POST", C, '{"model": "%s", "prompt": "x", "temperature": NaN}' % M, 400, "NaN"),
    ("infinity", "POST", C, '{"model": "%s", "prompt": "x", "top_p": Infinity}' % M, 400, "Infinity"),
    # a body without `model` is served by the default model, as vLLM does (tests/test_unknown_fields.py)
    ("model-not-a-string", "POST", C, {"model": 5, "prompt": "x"}, 400, "model"),
    ("missing-prompt", "POST", C, {"model": M}, 400, "prompt"),
    ("unknown-model", "POST", C, comp(model="gpt-9"), 404, "does not exist"),
    ("empty-prompt", "POST", C, comp(prompt=""), 400, "empty"),
    ("empty-prompt-list", "POST", C, comp(prompt=[]), 400, "empty"),
    ("prompt-number", "POST", C, comp(prompt=5), 400, "prompt must be"),
    ("oov-token", "POST", C, comp(prompt=[1, 999999]), 400, "out of vocabulary"),
    ("negative-token", "POST", C, comp(prompt=[-1]), 400, "out of vocabulary"),
    ("max-tokens-zero", "POST", C, comp(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", "POST", C, comp(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-string", "POST", C, comp(max_tokens="ten"), 400, "max_tokens"),
    ("over-context", "POST", C, comp(max_tokens=9000), 400, "8192"),
    ("temperature-negative", "POST", C, comp(temperature=-1), 400, "temperature"),
    ("temperature-huge", "POST", C, comp(temperature=1000), 400, "temperature"),
    ("top-p-zero", "POST", C, comp(top_p=0), 400, "top_p"),
    ("top-p-big", "POST", C, comp(top_p=1.5), 400, "top_p"),
    ("top-k-negative", "POST", C, comp(top_k=-3), 400, "top_k"),
    ("min-p-big", "POST", C, comp(min_p=2), 400, "min_p"),
    ("n-zero", "POST", C, comp(n=0), 400, "n must"),
    ("n-huge", "POST", C, comp(n=100), 400, "n must"),
    ("logprobs-huge", "POST", C, comp(logprobs=50), 400, "logprobs"),
    ("too-many-stops", "POST", C, comp(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("stop-too-long", "POST", C, comp(stop=["x" * 300]), 400, "stop"),
    ("stop-empty-string", "POST", C, comp(stop=[""]), 400, "stop"),
    ("logit-bias-key", "POST", C, comp(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit-bias-value", "POST", C, comp(logit_bias={"5": 500}), 400, "logit_bias"),
    ("logit-bias-oov", "POST", C, comp(logit_bias={"999999": 1}), 400, "out of vocabulary"),
    ("presence-penalty", "POST", C, comp(presence_penalty=5), 400, "presence_penalty"),
    ("frequency-penalty", "POST", C, comp(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition-penalty", "POST", C, comp(repetition_penalty=0), 400, "repetition_penalty"),
    ("unsupported-field", "POST", C, comp(tools=[]), 400, "unsupported field(s): tools"),
    ("suffix", "POST", C, comp(suffix="x"), 400, "suffix"),
    ("best-of", "POST", C, comp(best_of=3), 400, "best_of"),
    ("prompt-logprobs-huge", "POST", C, comp(prompt_logprobs=50), 400, "prompt_logprobs"),
    ("prompt-logprobs-string", "POST", C, comp(prompt_logprobs="1"), 400, "prompt_logprobs"),
    ("stop-token-oov", "POST", C, comp(stop_token_ids=[10**7]), 400, "out of vocabulary"),
    ("seed-string", "POST", C, comp(seed="abc"), 400, "seed"),
    ("min-tokens-over-max", "POST", C, comp(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("stream-not-bool", "POST", C, comp(stream="maybe"), 400, "stream"),
    ("too-many-prompts", "POST", C, comp(prompt=["a"] * 65), 400, "at most 64"),
    ("long-prompt-excerpt", "POST", C, comp(prompt=5, padding="y" * 5000), 400, "unsupported field"),
    ("long-field-name", "POST", C, comp(**{"z" * 5000: 1}), 400, "unsupported field"),
    ("long-logit-bias-key", "POST", C, comp(logit_bias={"9" * 5000: 1}), 400, "logit_bias"),
    ("lone-surrogate", "POST", C, '{"model": "%s", "prompt": "a\\ud800b"}' % M, 400, "surrogate"),
    ("deep-nesting", "POST", C, "[" * 100000 + "]" * 100000, 400, "nested too deeply"),
    ("number-overflow", "POST", C, '{"model": "%s", "prompt": "x", "temperature": 1e400}' % M, 400, "out of range"),
    ("max-tokens-numeric-string", "POST", C, comp(max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-float", "POST", C, comp(max_tokens=2.5), 400, "max_tokens"),
    ("prompt-bool-token", "POST", C, comp(prompt=[1, True]), 400, "prompt must be"),
    ("prompt-mixed-list", "POST", C, comp(prompt=["a", 1]), 400, "prompt must be"),
    ("best-of-equal-n", "POST", C, comp(best_of=2, n=2), 400, "best_of"),
    ("stream-options-without-stream", "POST", C, comp(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("logit-bias-underscore-key", "POST", C, comp(logit_bias={"1_0": 1}), 400, "logit_bias"),
    ("logprobs-negative", "POST", C, comp(logprobs=-1), 400, "logprobs"),
    ("stop-token-negative", "POST", C, comp(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("chat-empty-messages", "POST", CH, chat(messages=[]), 400, "messages"),
    ("chat-bad-role", "POST", CH, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    ("chat-image-part", "POST", CH, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages"),
    ("chat-missing-messages", "POST", CH, {"model": M}, 400, "messages"),
    ("chat-top-logprobs-alone", "POST", CH, chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat-top-logprobs-huge", "POST", CH, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("chat-tools", "POST", CH, chat(tools=[{"type": "function"}]), 400, "tools"),
    ("chat-response-format-type", "POST", CH, chat(response_format={"type": "xml"}), 400, "response_format"),
    ("chat-response-format-no-schema", "POST", CH, chat(response_format={"type": "json_schema"}), 400,
     "json_schema is required"),
    ("chat-bad-json-schema", "POST", CH, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}), 400, 'Unsupported type "objekt"'),
    ("chat-two-constraints", "POST", CH, chat(response_format={"type": "json_object"},
                                              structured_outputs={"regex": "a+"}), 400, "set only one of"),
    ("completion-bad-regex", "POST", C, comp(structured_outputs={"regex": "(a"}), 400, "parenthesis"),
    ("completion-two-kinds", "POST", C, comp(structured_outputs={"regex": "a", "choice": ["b"]}), 400, "exactly one"),
    ("completion-unenforceable-schema", "POST", C, comp(guided_json={"not": {"type": "string"}}), 400,
     "cannot enforce: not"),
    ("chat-over-context", "POST", CH, chat(max_completion_tokens=10**6), 400, "context"),
    ("chat-null-user-content", "POST", CH, chat(messages=[{"role": "user", "content": None}]), 400, "content"),
    ("chat-tool-message-without-id", "POST", CH, chat(messages=[{"role": "tool", "content": "x"}]), 400, "tool_call_id"),
    ("chat-part-without-text", "POST", CH, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400,
     "content must be"),
    ("chat-functions", "POST", CH, chat(functions=[{"name": "f"}]), 400, "functions"),
    ("chat-n-bool", "POST", CH, chat(n=True), 400, "n"),
    ("chat-stop-ints", "POST", CH, chat(stop=[1, 2]), 400, "stop must be"),
    ("unknown-route-post", "POST", "/v2/completions", {}, 404, "no route"),
    ("tokenize-both", "POST", "/tokenize", {"prompt": "x", "messages": USER}, 400, "exactly one"),
    ("detokenize-strings", "POST", "/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("unknown-route", "GET", "/v1/nope", None, 404, "no route"),
    ("wrong-method-delete", "DELETE", C, None, 405, "not allowed"),
    ("wrong-method-get", "GET", CH, None, 405, "not allowed"),
    ("body-too-large", "POST", C, b"x" * (5 * 2**20), 413, "exceeds"),
    ("detokenize-oov", "POST", "/detokenize", {"tokens": [10**8]}, 400, "out of vocabulary"),
    ("tokenize-neither", "POST", "/tokenize", {}, 400, "exactly one"),
    ("tgi-missing-inputs", "POST", "/generate", {"parameters": {}}, 422, "inputs"),
    ("tgi-zero-tokens", "POST", "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 0}}, 422, "max_tokens"),
    ("tgi-bad-temperature", "POST", "/generate", {"inputs": "x", "parameters": {"temperature": -1}}, 422,
     "temperature"),
    ("tgi-unknown-parameter", "POST", "/generate", {"inputs": "x", "parameters": {"best": 1}}, 422, "unsupported"),
    ("tgi-stream-invalid-json", "POST", "/generate_stream", "{{", 422, "not valid JSON"),
    ("tgi-empty-inputs", "POST", "/generate", {"inputs": ""}, 422, "empty"),
    ("tgi-decoder-input-details-stream", "POST", "/generate_stream", {"inputs": "x", "parameters": {
        "decoder_input_details": True}}, 422, "decoder_input_details"),
    ("tgi-watermark", "POST", "/generate", {"inputs": "x", "parameters": {"watermark": True}}, 422, "watermark"),
    ("tgi-stream-field-on-generate", "POST", "/generate", {"inputs": "x", "stream": True}, 422, "stream"),
    ("tgi-zero-temperature", "POST", "/generate_stream", {"inputs": "x", "parameters": {
        "do_sample": True, "temperature": 0}}, 422, "temperature"),
    ("tgi-compat-bad-inputs", "POST", "/", {"inputs": 5}, 422, "inputs"),
]
CANARY_EVERY = 10  # cases between canary requests (and once more at the end)


@pytest.fixture(scope="module")
def server():
    """--strict-fields: the unknown-field cases above are refused (by default they are ignored and named in
    X-Ignored-Fields: tests/test_unknown_fields.py)."""
    with running_server("--strict-fields") as s:
        yield s


def canary(server) -> None:
    r = httpx.post(server.url + C, json={"model": M, "prompt": "The capital of France is", "max_tokens": 2,
                                         "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris."
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("number,case", list(enumerate(CASES)), ids=[c[0] for c in CASES])
def test_bad_input(server, number, case):
    _, method, path, body, status, match = case
    kw = {"json": body} if isinstance(body, dict) else {"content": body} if body is not None else {}
    headers = {"Content-Type": "application/json"} if body is not None else {}
    r = httpx.request(method, server.url + path, headers=headers, timeout=60, **kw)
    assert r.status_code == status, r.text[:300]
    err = r.json()
    if path in ("/", "/generate", "/generate_stream"):
        assert set(err) == {"error", "error_type"} and match in err["error"], err
        message = err["error"]
    else:
        assert set(err["error"]) == {"message", "type", "param", "code"}, err
        message = err["error"]["message"]
        assert match in message, message
    assert len(message) <= 400 and "Traceback" not in r.text and "/site-packages/" not in r.text
    assert "/work/" not in r.text and not any(c * 41 in r.text for c in "yz9")  # input only in short excerpts
    if number % CANARY_EVERY == CANARY_EVERY - 1:
        canary(server)


def test_chunked_body_over_the_limit_gets_413(server):
    """No Content-Length: the limit is enforced on the bytes as they stream in."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 2**16
        try:
            for _ in range(4 * 2**20 // len(chunk) + 1):  # just past the 4 MiB default, then stop sending
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass  # the server may answer and close while the last chunk is on its way
        response = b""
        while b"}}" not in response and (part := s.recv(65536)):
            response += part
    assert response.startswith(b"HTTP/1.1 413") and b"exceeds the limit" in response


def test_server_healthy_and_correct_after_bad_inputs(server):
    assert len(CASES) >= 40
    canary(server)
    server.wait_idle()


ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("key-file\n\n")
    with running_server("--api-key", "key-one", "--api-key", "key-two", "--api-key-file", str(key_file),
                        "--max-num-seqs", "1", "--max-queued-requests", "0", "--cors-allowed-origins", ORIGIN,
                        env={"LMSERVE_API_KEY": "key-env"}, headers={"Authorization": "Bearer key-one"}) as s:
        yield s


AUTH_ROUTES = [("GET", "/v1/models"), ("POST", C), ("POST", CH), ("POST", "/generate"), ("POST", "/generate_stream"),
               ("POST", "/"), ("GET", "/info"), ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize"),
               ("GET", "/version"), ("GET", "/v1/no-such-route")]


@pytest.mark.parametrize("method,path", AUTH_ROUTES)
def test_auth_required_everywhere_but_health(guarded, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-one"},
                    {"Authorization": "Bearer key-one-and-more"}, {"Authorization": "Bearer"},
                    {"Authorization": "Token key-one"}):
        r = httpx.request(method, guarded.url + path, headers=headers, json={})
        assert r.status_code == 401
        body = r.json()
        if path in ("/", "/generate", "/generate_stream", "/info"):  # TGI routes answer in TGI's shape
            assert body["error_type"] == "authentication"
        else:
            assert body["error"]["code"] == "invalid_api_key"
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_each_accepted_key_works(guarded):
    for key in ("key-one", "key-two", "key-env", "key-file"):
        r = httpx.get(guarded.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200


def test_cors_preflight_and_allowed_origin(guarded):
    preflight = httpx.options(guarded.url + C, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                         "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(guarded.url + "/v1/models", headers={"Origin": ORIGIN, **guarded.headers})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(guarded.url + "/v1/models", headers={"Origin": "http://evil.example", **guarded.headers})
    assert "access-control-allow-origin" not in other.headers


def test_queue_full_gets_503_with_retry_after(guarded):
    auth = {"Authorization": "Bearer key-one"}
    body = {"model": M, "prompt": "Tell a long story", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", guarded.url + C, json=body, headers=auth, timeout=60) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept referenced: dropping it would close the connection
        next(lines)  # the first request holds the only slot (its first token is out)
        r = httpx.post(guarded.url + C, json={"model": M, "prompt": "x", "max_tokens": 1}, headers=auth)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "capacity" in r.json()["error"]["message"]
    # the slot comes back once the server sees the client gone (only an admin reads /metrics; these are plain keys)
    deadline = time.time() + 60
    while (r := httpx.post(guarded.url + C, json={"model": M, "prompt": "x", "max_tokens": 1}, headers=auth,
                           timeout=60)).status_code == 503 and time.time() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def _stream_completion(url: str, body: dict, started: threading.Event, results: list[dict]) -> None:
    """Read one SSE completion to its end; set `started` at the first chunk."""
    chunks, done = [], False
    with httpx.stream("POST", url + C, json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
                started.set()
    results.append({"max_tokens": body["max_tokens"], "done": done,
                    "finish": chunks[-1]["choices"][0]["finish_reason"] if chunks else None,
                    "text": "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))})


@pytest.mark.slow
def test_sigterm_drains_streams_and_exits_zero():
    """Two streams finish within the drain timeout; one that cannot is aborted; the process exits 0."""
    with running_server("--drain-timeout", "6", "--served-model-name", "storyteller") as s:
        assert 503 in s.health_seen  # /health said 503 while the model loaded
        assert [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]] == ["storyteller"]
        results: list[dict] = []
        events = [threading.Event() for _ in range(3)]
        threads = [threading.Thread(target=_stream_completion, args=(s.url, {
            "model": "storyteller", "prompt": f"Story {i}:", "max_tokens": (48, 48, 4000)[i], "ignore_eos": True,
            "stream": True}, events[i], results)) for i in range(3)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in events)  # every stream is under way
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(s.url + C, json={"model": "storyteller", "prompt": "x", "max_tokens": 1}, timeout=10)
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 503
        for t in threads:
            t.join(timeout=60)
        assert s.proc.wait(timeout=30) == 0
        by_length = sorted(results, key=lambda r: r["max_tokens"])
        assert len(results) == 3 and all(r["done"] and r["text"] for r in results)
        assert [r["finish"] for r in by_length] == ["length", "length", "abort"]
