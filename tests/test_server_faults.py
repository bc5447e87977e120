"""Engine faults through the real server (LMSERVE_TEST_FAULT): a failed step answers its requests with 500 and the
server serves on; a dead engine turns /health to 503 at once and the process exits 1 for its supervisor."""

from __future__ import annotations

import time
from unittest.mock import ANY

import anthropic
import httpx
import openai
import pytest

from tests.server_util import running_server, unhealthy_within

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_failed_steps_answer_500_and_the_server_serves_on():
    # Forwards 1 and 2 after warm-up fail: two in a row, below the limit that kills the engine.
    with running_server(env={"LMSERVE_TEST_FAULT": "step:1:2"}) as s:
        c = client(s)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert e.value.status_code == 500 and e.value.body["code"] == "engine_step_failed"
        with pytest.raises(openai.APIError, match="engine step running this request failed"):
            for _ in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, stream=True):
                pass
        ok = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 4
        assert httpx.get(s.url + "/health").status_code == 200
        s.wait_idle()
        assert s.metric("lmserve:kv_cache_free_blocks") == s.metric("lmserve:kv_cache_total_blocks")
        assert s.metric("lmserve:engine_step_failures_total") == 2
        assert s.metric("lmserve:engine_dead") == 0


def test_engine_failures_in_anthropic_shape():
    """The same faults through Anthropic's Messages API: a whole answer is a 500 api_error, a stream an `error` event
    (which the official client raises); then the server answers again, every block free."""
    hi = [{"role": "user", "content": "hi"}]
    with running_server(env={"LMSERVE_TEST_FAULT": "step:1:2"}) as s:
        c = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(anthropic.InternalServerError) as e:
            c.messages.create(model=MODEL, max_tokens=4, messages=hi)
        assert e.value.body == {"type": "error", "error": {"type": "api_error", "message": ANY}}
        with pytest.raises(anthropic.APIStatusError, match="engine step running this request failed"):
            with c.messages.stream(model=MODEL, max_tokens=4, messages=hi) as stream:
                stream.until_done()
        ok = c.messages.create(model=MODEL, max_tokens=4, messages=hi, extra_body={"temperature": 0})
        assert ok.stop_reason == "max_tokens" and ok.usage.output_tokens == 4
        s.wait_idle()
        assert s.metric("lmserve:engine_step_failures_total") == 2


def test_a_dead_engine_fails_health_at_once_and_exits_nonzero():
    with running_server(env={"LMSERVE_TEST_FAULT": "thread:1"}) as s:
        start = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert unhealthy_within(s.url, 1.0, start)
        assert s.proc.wait(timeout=15) == 1

def test_a_hung_engine_fails_health_within_the_step_timeout_and_exits_nonzero():
    """The 2nd forward after warm-up never returns: the watchdog (--engine-step-timeout 1) declares the engine dead."""
    with running_server("--engine-step-timeout", "1", env={"LMSERVE_TEST_FAULT": "hang:2"}) as s:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
        start = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)  # its 1st decode step hangs
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert time.monotonic() - start < 1 + 1.0  # the timeout, then at most a tenth of it to notice
        assert unhealthy_within(s.url, 2.0, start)
        assert s.proc.wait(timeout=15) == 1
