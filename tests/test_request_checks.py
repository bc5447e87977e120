"""EngineFront.check_request runs once per engine request: on the HTTP path (the real app in-process,
on the embedded model) and on the offline path (LLM.generate -> add_request)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from lmserve.config import CacheConfig, EngineConfig
from lmserve.engine.llm import LLM
from lmserve.engine.llm_engine import LLMEngine
from lmserve.sampling_params import SamplingParams
from lmserve.server.app import build_app
from lmserve.server.main import start_engine
from lmserve.server.metrics import ServerMetrics
from lmserve.server.state import ServerConfig, ServerState

M = "m"


class CountedChecks:
    """Wraps an engine's check_request (every caller goes through its front end's instance attribute) and counts
    calls."""

    def __init__(self, engine: LLMEngine) -> None:
        self.calls = 0
        self._check = engine.front.check_request
        engine.front.check_request = self

    def __call__(self, prompt_ids: list[int], params: SamplingParams) -> int:
        self.calls += 1
        return self._check(prompt_ids, params)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(num_threads=2, cache=CacheConfig(kv_cache_memory=64 * 2**20)))


@pytest.fixture(scope="module")
def served(engine):
    """The real app over a started engine thread, as `lmserve serve` wires it; yields (client, counter)."""
    state = ServerState(ServerConfig(M), ServerMetrics(M))
    counter = CountedChecks(engine)
    start_engine(state, engine, 0.0)
    with TestClient(build_app(state)) as client:
        yield client, counter
    state.async_engine.shutdown()


COMPLETION = {"model": M, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
CHAT = {"model": M, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TGI = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 2}}


@pytest.mark.parametrize("path,body,prompts", [
    ("/v1/completions", COMPLETION, 1),
    ("/v1/completions", {**COMPLETION, "stream": True}, 1),
    ("/v1/completions", {**COMPLETION, "n": 2}, 1),  # n completions are one engine request
    ("/v1/completions", {**COMPLETION, "prompt": ["a", "b", "c"]}, 3),  # one engine request per prompt
    ("/v1/chat/completions", CHAT, 1),
    ("/v1/chat/completions", {**CHAT, "stream": True}, 1),
    ("/generate", TGI, 1),
    ("/generate_stream", TGI, 1),
], ids=["completion", "completion-stream", "completion-n2", "three-prompts", "chat", "chat-stream", "tgi",
        "tgi-stream"])
def test_each_http_request_is_checked_once_per_prompt(served, path, body, prompts):
    client, counter = served
    before = counter.calls
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert counter.calls - before == prompts


def test_a_rejected_request_is_checked_once_and_still_gets_400(served):
    """8,190 new tokens pass the byte bound (the 24-byte prompt is at least 1 token: 8,191 <= 8,192) and fail the
    exact check (its 5+ tokens do not fit): one check, one 400."""
    client, counter = served
    before = counter.calls
    r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 8190})
    assert r.status_code == 400 and "8192" in r.json()["error"]["message"]
    assert counter.calls - before == 1


def test_a_request_that_cannot_fit_by_its_bytes_is_refused_before_the_check(served):
    """9,000 new tokens cannot fit the 8,192-token context whatever the prompt: refused before tokenizing."""
    client, counter = served
    before = counter.calls
    r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 9000})
    assert r.status_code == 400 and "8192" in r.json()["error"]["message"]
    assert counter.calls == before


def test_each_offline_prompt_is_checked_once(engine):
    offline = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64)), loaded=engine.loaded,
                        tokenizer=engine.tokenizer)  # its own engine: the served one belongs to its thread
    counter = CountedChecks(offline)
    LLM(engine=offline).generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert counter.calls == 2
