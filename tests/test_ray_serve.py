"""lmserve replicas on a real local Ray cluster: 2 engine replicas of 1 thread each behind Serve's proxy.

One cluster and application for the module (Ray and two model loads cost ~50 s here); the official
openai client talks to Serve's HTTP proxy. The replica-killing test runs last: it leaves the cluster
with a replacement replica.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time

import httpx
import openai
import pytest

from tests.server_util import MODEL, free_port

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPLICA = "x-lmserve-replica"


@pytest.fixture(scope="module")
def cluster():
    """Serve's URL, over a fresh local Ray cluster (2 CPUs) running the lmserve application."""
    from lmserve.deploy.ray_serve import app

    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"num_replicas": "2", "num_threads": "1", "health_check_period_s": "1",
                "serve_args": f"--kv-cache-memory {64 * 2**20} --no-playground --batch-dir {tmp}/batches"}
        serve.run(app(args), name="lmserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


STATUSES: list[int] = []  # every HTTP status the clients got, retried attempts included


def client(url: str, retries: int = 0) -> openai.OpenAI:
    hooks = {"response": [lambda r: STATUSES.append(r.status_code)]}
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=retries, timeout=60,
                         http_client=httpx.Client(event_hooks=hooks))


def complete(url: str, prompt: str, max_tokens: int = 2, retries: int = 0) -> tuple[str, str]:
    """(the replica that answered, the text)."""
    raw = client(url, retries).completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return raw.headers[REPLICA], raw.parse().choices[0].text


def test_openai_client_plain_and_streamed(cluster):
    c = client(cluster)
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True)
    streamed = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert len(streamed) > 2 and "".join(streamed) == whole.choices[0].message.content  # real SSE, same text
    replica, text = complete(cluster, "The capital of France is", max_tokens=4)
    assert replica and text
    assert [m.id for m in c.models.list().data] == [MODEL]


def test_errors_keep_lmserve_shape(cluster):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(cluster).completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    r = httpx.post(cluster + "/v1/completions", content=b"x" * (4 * 2**20 + 1), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_requests_spread_across_replicas_and_a_shared_prefix_sticks(cluster):
    spread = {complete(cluster, f"Request number {i} asks about something else entirely.")[0] for i in range(12)}
    assert len(spread) == 2, "12 distinct prompts all went to one replica (chance 2**-11)"
    system = "You are a terse assistant. " * 12  # 324 characters: past the router's 256-character key
    sticky = {complete(cluster, f"{system}Question {i}: what is {i} + {i}?")[0] for i in range(6)}
    assert len(sticky) == 1, f"prompts sharing a prefix went to several replicas: {sticky}"
    # The prefix cache did its work on that replica: read its own /metrics through the pinning header.
    metrics = httpx.get(cluster + "/metrics", headers={REPLICA: sticky.pop()}, timeout=30)
    hits = [float(line.split()[-1]) for line in metrics.text.splitlines()
            if line.startswith("lmserve:prefix_cache_hit_tokens")]
    assert hits and hits[0] >= 5 * 64, metrics.text[:300]  # 5 requests reused >= 4 blocks of 16 tokens each


def replica_metric(url: str, replica: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers={REPLICA: replica}, timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith((name + " ", name + "{"))))


def test_a_client_leaving_a_stream_frees_its_kv_blocks_on_the_replica(cluster):
    body = {"model": MODEL, "prompt": "Write a very long story about a ship.", "max_tokens": 1200, "stream": True,
            "ignore_eos": True,
            "temperature": 0}
    with httpx.stream("POST", cluster + "/v1/completions", json=body, timeout=60) as r:
        replica = r.headers[REPLICA]
        chunks = r.iter_lines()
        assert [next(chunks) for _ in range(3)]  # generation is under way on that replica
    wait_for_free_blocks(cluster, replica)


def wait_for_free_blocks(url: str, replica: str, timeout: float = 10) -> None:
    """Until the replica runs nothing and every KV block is free: an abandoned request was aborted there
    (the disconnect travels proxy -> ingress -> replica, whose route aborts the engine request). The
    requests ask for 1,200 tokens, ~30 s of decoding here: finishing on their own would take too long."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        free = replica_metric(url, replica, "lmserve:kv_cache_free_blocks")
        if free == replica_metric(url, replica, "lmserve:kv_cache_total_blocks"):
            assert replica_metric(url, replica, "lmserve:num_requests_running") == 0
            return
        time.sleep(0.2)
    raise AssertionError("the abandoned request kept its KV blocks")


def test_a_client_leaving_before_a_whole_answer_frees_its_kv_blocks(cluster):
    replica = complete(cluster, "Which replica?")[0]
    body = {"model": MODEL, "prompt": "Write a very long story about a ship.", "max_tokens": 1200, "temperature": 0,
            "ignore_eos": True}
    running: list[float] = []
    watcher = threading.Thread(target=lambda: [running.append(
        replica_metric(cluster, replica, "lmserve:num_requests_running")) for _ in range(10)])
    watcher.start()
    with pytest.raises(httpx.ReadTimeout):  # pinned to `replica`, so its metrics tell what happened to it
        httpx.post(cluster + "/v1/completions", json=body, headers={REPLICA: replica}, timeout=4)
    watcher.join()
    assert 1 in running  # it did run there
    wait_for_free_blocks(cluster, replica)


def test_killed_replica_is_replaced_and_client_retries_succeed(cluster):
    victim = complete(cluster, "Which replica are you?")[0]
    before = engine_replicas()
    assert victim in before and len(before) == 2
    results: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def load(n: int) -> None:
        i = 0
        while not stop.is_set():
            try:  # the openai client's own retries (with back-off) are the only retries here
                results.append(complete(cluster, f"Load {n}.{i}: count to three.", max_tokens=8, retries=5)[0])
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)
            i += 1

    stream_lines: list[str] = []

    def stream_on_victim() -> None:  # a stream under way on the replica that is about to die
        body = {"model": MODEL, "prompt": "Tell a long tale.", "max_tokens": 1200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", cluster + "/v1/completions", json=body, headers={REPLICA: victim}, timeout=60) as r:
            stream_lines.extend(line for line in r.iter_lines() if line)

    threads = [threading.Thread(target=load, args=(n,)) for n in range(3)]
    threads.append(threading.Thread(target=stream_on_victim))
    for t in threads:
        t.start()
    while len(results) < 3 or len(stream_lines) < 3:
        time.sleep(0.05)
    actor = ray.get_actor(f"SERVE_REPLICA::lmserve#LMServerEngine#{victim}", namespace="serve")
    ray.kill(actor, no_restart=True)
    killed_at = len(results)
    replacement = _wait_for_replacement(before, victim, timeout=120)
    time.sleep(1)
    stop.set()
    for t in threads:
        t.join(timeout=90)
    assert not errors, f"requests lost for good: {errors[:3]}"
    # The stream the dead replica was sending ends with an error event, not a silent cut.
    assert "data: [DONE]" not in stream_lines and "error" in json.loads(stream_lines[-1].removeprefix("data: "))
    print(f"{len(results)} requests, {STATUSES.count(503)} 503s retried by the client")
    assert len(results) > killed_at + 3  # traffic kept flowing while the replica was down and after
    seen = {complete(cluster, f"After the restart {i}, a new prompt.")[0] for i in range(12)}
    assert replacement in seen and victim not in seen


def engine_replicas() -> set[str]:
    """The ids of the engine replicas whose actors are alive (Serve names them after the replica id)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {n.rsplit("#", 1)[1] for n in names if n.startswith("SERVE_REPLICA::lmserve#LMServerEngine#")}


def _wait_for_replacement(before: set[str], victim: str, timeout: float) -> str:
    """The id of the replica Serve started in place of `victim`, once it runs and the deployment is healthy."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        now = engine_replicas()
        deployment = serve.status().applications["lmserve"].deployments["LMServerEngine"]
        running = deployment.replica_states.get("RUNNING", 0)  # the replacement has loaded its model
        if len(now) == 2 and victim not in now and running == 2 and deployment.status == "HEALTHY":
            return (now - (before - {victim})).pop()
        time.sleep(0.5)
    raise AssertionError("Serve did not bring the killed replica back")
