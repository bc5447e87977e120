"""/metrics under a scripted workload of known shape: counts and sums move exactly; no unbounded series."""

from __future__ import annotations

import re
import uuid

import httpx
import openai
import pytest

from tests.server_util import MODEL, running_server


@pytest.fixture(scope="module")
def fresh():
    with running_server() as s:
        yield s


def series(server) -> set[str]:
    """Every sample name with its labels (values stripped)."""
    text = httpx.get(server.url + "/metrics").text
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics_move_exactly(fresh):
    c = openai.OpenAI(base_url=fresh.url + "/v1", api_key="unused", max_retries=0)
    usage_prompt = usage_completion = 0
    for i in range(5):
        r = c.completions.create(model=MODEL, prompt=f"Item {i}:", max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
        usage_prompt += r.usage.prompt_tokens
        usage_completion += r.usage.completion_tokens
    for i in range(3):
        chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Hi {i}"}],
                                                max_tokens=3, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        usage_prompt += chunks[-1].usage.prompt_tokens
        usage_completion += chunks[-1].usage.completion_tokens
    r = c.completions.create(model=MODEL, prompt="Pair:", max_tokens=2, n=2, temperature=0.5,
                             extra_body={"ignore_eos": True})
    usage_prompt += r.usage.prompt_tokens
    usage_completion += r.usage.completion_tokens
    fresh.wait_idle()

    completions, requests = 5 + 3 + 2, 5 + 3 + 1
    m = fresh.metric
    assert usage_completion == 5 * 4 + 3 * 3 + 2 * 2
    assert m("lmserve:request_success_total", 'finish_reason="length"') == completions
    for hist in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_generation_tokens"):
        assert m(f"lmserve:{hist}_count") == completions, hist
    assert m("lmserve:request_prompt_tokens_count") == requests
    assert m("lmserve:inter_token_latency_seconds_count") == usage_completion - completions  # gaps between tokens
    assert m("lmserve:generation_tokens_total") == usage_completion == m("lmserve:request_generation_tokens_sum")
    assert m("lmserve:prompt_tokens_total") == usage_prompt
    assert m("lmserve:kv_cache_usage_perc") == 0.0
    assert m("lmserve:num_requests_running") == 0 and m("lmserve:num_requests_waiting") == 0
    assert m("lmserve:model_load_seconds") > 0 and m("lmserve:model_warmup_seconds") > 0
    assert m("lmserve:model_info", 'quantization="MOSTLY_Q4_1"') == 1  # the file's own type
    assert m("lmserve:model_info", 'weight_format="gguf"') == 1  # how it is served: --quantization auto chose gguf


def test_health_while_loading_is_not_ready_not_a_server_error(fresh):
    """The 503s /health answers during start-up are counted as not_ready; a start adds no 5xx."""
    assert fresh.health_seen.count(503) > 0  # the start was polled while the model loaded
    assert fresh.metric("lmserve:requests_total", 'status="not_ready"') == fresh.health_seen.count(503)
    assert fresh.metric("lmserve:requests_total", 'status="5xx"') == 0


def test_random_model_names_add_no_series(fresh):
    before = series(fresh)
    errors_before = fresh.metric("lmserve:requests_total", 'status="4xx"')
    invalid_before = fresh.metric("lmserve:requests_rejected_total", 'reason="invalid_request"')
    with httpx.Client(base_url=fresh.url) as client:
        for _ in range(1000):
            r = client.post("/v1/completions", json={"model": uuid.uuid4().hex, "prompt": "x"})
            assert r.status_code == 404
        for _ in range(50):  # random routes and methods neither
            assert client.request("PATCH", f"/{uuid.uuid4().hex}").status_code in (404, 405)
    after = series(fresh)
    assert after == before
    assert fresh.metric("lmserve:requests_total", 'status="4xx"') == errors_before + 1050
    assert fresh.metric("lmserve:requests_rejected_total", 'reason="invalid_request"') == invalid_before + 1000
    assert not any(re.search(r"[0-9a-f]{32}", s) for s in after)


def test_rejections_and_aborts_by_reason(fresh):
    """Each refusal and abort is counted once under its reason."""
    m = fresh.metric
    before = {r: m("lmserve:requests_rejected_total", f'reason="{r}"') for r in ("context_length", "invalid_request")}
    aborts = m("lmserve:request_aborts_total", 'reason="client_disconnect"')
    with httpx.Client(base_url=fresh.url, timeout=30) as client:
        for _ in range(3):  # prompt + max_tokens past the context window
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 10**7})
            assert r.status_code == 400
        for _ in range(2):
            assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 7}).status_code == 400
        with pytest.raises(httpx.ReadTimeout):  # hang up while it generates
            client.post("/v1/completions", timeout=0.5,
                        json={"model": MODEL, "prompt": "x", "max_tokens": 400, "ignore_eos": True})
    fresh.wait_idle()
    assert m("lmserve:requests_rejected_total", 'reason="context_length"') == before["context_length"] + 3
    assert m("lmserve:requests_rejected_total", 'reason="invalid_request"') == before["invalid_request"] + 2
    assert m("lmserve:request_aborts_total", 'reason="client_disconnect"') == aborts + 1
    assert m("lmserve:num_preemptions_total") == 0
