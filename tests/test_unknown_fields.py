"""vLLM's habits on the wire: unknown body fields are ignored (logged, named in X-Ignored-Fields) unless
--strict-fields; known but unsupported fields keep their 400; `model` may be left out; one access-log line per
request (--no-access-log: none)."""

from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager

import httpx
import pytest
from openai import OpenAI

from tests.server_util import MODEL, running_server

C, CH = "/v1/completions", "/v1/chat/completions"
GREEDY = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}


@contextmanager
def logged_server(log_path, *args: str):
    """A server whose log goes to `log_path`, at INFO (the access log's level)."""
    before = os.environ.get("LMSERVE_TEST_SERVER_LOG")
    os.environ["LMSERVE_TEST_SERVER_LOG"] = str(log_path)
    try:
        with running_server("--log-level", "info", *args) as s:
            yield s
    finally:
        if before is None:
            os.environ.pop("LMSERVE_TEST_SERVER_LOG")
        else:
            os.environ["LMSERVE_TEST_SERVER_LOG"] = before


@pytest.fixture(scope="module")
def lenient(tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    with logged_server(log) as s:
        s.log = log
        yield s


def log_lines(server, pattern: str, timeout: float = 10) -> list[str]:
    """Lines of the server's log matching `pattern` (waiting for the line of a response just sent)."""
    deadline = time.time() + timeout
    while True:
        found = [line for line in server.log.read_text().splitlines() if re.search(pattern, line)]
        if found or time.time() > deadline:
            return found
        time.sleep(0.1)


def test_unknown_fields_are_ignored_named_and_logged(lenient):
    r = httpx.post(lenient.url + C, json={"model": MODEL, **GREEDY, "foo_bar": 1, "stream_options_v9": {"x": 1}},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"] == "foo_bar, stream_options_v9"
    assert r.json()["choices"][0]["text"] == " Paris."  # the same answer as without them
    assert log_lines(lenient, r"/v1/completions: ignored unknown field\(s\) foo_bar, stream_options_v9")


def test_an_unknown_field_inside_a_known_object_is_ignored_too(lenient):
    body = {"model": MODEL, **GREEDY, "stream": True, "stream_options": {"include_usage": True, "new_flag": True}}
    with httpx.stream("POST", lenient.url + C, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-ignored-fields"] == "stream_options.new_flag"
        text = r.read().decode()
    assert '"usage"' in text and text.rstrip().endswith("data: [DONE]")


def test_a_request_without_unknown_fields_has_no_header(lenient):
    r = httpx.post(lenient.url + C, json={"model": MODEL, **GREEDY}, timeout=60)
    assert r.status_code == 200 and "x-ignored-fields" not in r.headers


def test_an_unknown_field_name_with_control_or_non_ascii_characters_is_percent_encoded(lenient):
    """The name is the client's text: a newline or a NUL in it must not break the header (the fuzzer once made
    the server drop the connection this way, h11 refusing the header), on a 200 and on a 400 alike."""
    r = httpx.post(lenient.url + C, json={"model": MODEL, **GREEDY, "a\nb\x00\u00e9": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"] == "a%0Ab%00%C3%A9"
    r = httpx.post(lenient.url + CH, json={"model": MODEL, "messages": [{"name": "\x04", "k\n": 1}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    # an empty key (the fuzzer's next find: "x, " ends in a space, which h11 refuses too), and a header cut at 1 KiB
    r = httpx.post(lenient.url + C, json={"model": MODEL, **GREEDY, "\x01": 1, "": 2}, timeout=60)
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == '%01, ""', r.text
    r = httpx.post(lenient.url + C, json={"model": MODEL, **GREEDY, **{"k" * 37 + f"{i:02}": 1 for i in range(40)}},
                   timeout=60)
    assert r.status_code == 200 and not r.headers["x-ignored-fields"].endswith((",", " ")), r.text


def test_known_but_unsupported_fields_keep_their_400(lenient):
    for body, field in (({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of")):
        r = httpx.post(lenient.url + C, json={"model": MODEL, **GREEDY, **body}, timeout=60)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_model_may_be_left_out_when_one_model_is_served(lenient):
    r = httpx.post(lenient.url + C, json=GREEDY, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == MODEL and r.json()["choices"][0]["text"] == " Paris."
    chat = httpx.post(lenient.url + CH, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                      timeout=60)
    assert chat.status_code == 200 and chat.json()["model"] == MODEL


def test_the_official_client_sends_extra_body_fields(lenient):
    client = OpenAI(base_url=lenient.url + "/v1", api_key="unused")
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="The capital of France is", max_tokens=2,
                                                      temperature=0, extra_body={"reasoning_effort_v2": "low"})
    assert raw.headers["x-ignored-fields"] == "reasoning_effort_v2" and raw.parse().choices[0].text == " Paris."


def test_one_access_log_line_per_request_with_tokens_and_id(lenient):
    r = httpx.post(lenient.url + CH, json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                           "max_tokens": 3, "temperature": 0}, timeout=60)
    rid, usage = r.json()["id"], r.json()["usage"]
    [line] = log_lines(lenient, rf"id {rid}$")
    assert re.search(rf'127\.0\.0\.1:\d+ "POST /v1/chat/completions" 200 [0-9.]+ ms tokens '
                     rf'{usage["prompt_tokens"]}\+{usage["completion_tokens"]} id {rid}$', line), line
    httpx.get(lenient.url + "/v1/nope")
    assert log_lines(lenient, r'"GET /v1/nope" 404 [0-9.]+ ms tokens - id -$')


def test_strict_fields_and_no_access_log(tmp_path):
    log = tmp_path / "server.log"
    with logged_server(log, "--strict-fields", "--no-access-log") as s:
        r = httpx.post(s.url + C, json={"model": MODEL, **GREEDY, "foo_bar": 1}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_field"
        assert "foo_bar" in r.json()["error"]["message"] and "x-ignored-fields" not in r.headers
        assert httpx.post(s.url + C, json=GREEDY, timeout=60).status_code == 200  # model still optional
    assert "POST /v1/completions" not in log.read_text()
