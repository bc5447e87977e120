"""Disaggregated prefill and decode on a real local Ray cluster: 1 prefill + 1 decode replica (1 thread each) over
one real redis-server, against a plain `lmserve serve` process as the colocated reference.

Long prompts (past the app's pd_min_prompt_chars) are computed by the prefill replica, whose blocks the decode
replica loads from Redis: greedy outputs equal the colocated server's on 16 prompts, and the decode replica's
shared-tier hits are exactly each prompt's full blocks. Another API key's salted blocks never hit. The prefill
replica killed: requests fall back to colocated serving on the decode replica within 5 s, and /health names the
missing role. The kill runs last: Serve then restarts the prefill replica.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.redis_server import redis_server
from tests.server_util import MODEL, free_port, running_server

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.serial]
KEYS = ("sk-pd-a-0123456789abcdef", "sk-pd-b-0123456789abcdef")
MIN_CHARS = 300
WORDS = ("The warehouse ships each order from the nearest depot, checks the part number twice and writes the "
         "delivery date on the slip before the van leaves. ").split()


def prompt(i: int, words: int = 90) -> str:
    """~120 tokens (past MIN_CHARS), sharing no first block with another i."""
    return f"Case {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))


@pytest.fixture(scope="module")
def cluster():
    """(Serve's URL, the colocated reference server, the redis server), over a fresh 2-CPU Ray cluster."""
    from lmserve.deploy.ray_serve import app

    keys = [a for k in KEYS for a in ("--api-key", k)]
    with redis_server() as srv, ThreadPoolExecutor(1) as pool:
        tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
        port = free_port()
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
        reference = running_server(*keys, "--num-threads", "1")
        started = pool.submit(reference.__enter__)  # loads its model while Serve starts the replicas
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            args = {"num_replicas": "1", "prefill_replicas": "1", "num_threads": "1", "health_check_period_s": "1",
                    "pd_min_prompt_chars": str(MIN_CHARS),
                    "serve_args": f"--kv-shared {srv.url} --kv-cache-memory {64 * 2**20} --no-playground "
                                  f"--metrics-public {' '.join(keys)} --batch-dir {tmp}/batches"}
            serve.run(app(args), name="lmserve", route_prefix="/")
            yield f"http://127.0.0.1:{port}", started.result(), srv
        finally:
            serve.shutdown()
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)
            reference.__exit__(None, None, None)


def complete(url: str, text: str, key: str = KEYS[0], chat: bool = False) -> tuple[int, list]:
    """(prompt tokens, [text, tokens, logprobs]) of a greedy answer."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    if chat:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=8,
                                           temperature=0, logprobs=True)
        lp = r.choices[0].logprobs.content
        return r.usage.prompt_tokens, [r.choices[0].message.content, [t.token for t in lp]]
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0, logprobs=1)
    return r.usage.prompt_tokens, [r.choices[0].text, r.choices[0].logprobs.tokens]


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def metric(text: str, name: str, labels: str = "") -> float:
    """A Prometheus sample's value (labels as written, e.g. 'tier="shared"')."""
    pattern = re.escape(name) + (r"\{[^}]*" + re.escape(labels) + r"[^}]*\}" if labels else r"(\{[^}]*\})?")
    return float(re.search(r"^" + pattern + r" ([0-9.e+-]+)$", text, re.M).groups()[-1])


def prefill_metric(name: str, labels: str = "") -> float:
    """From the prefill replica's /metrics, through its deployment handle (the ingress routes to decode)."""
    from lmserve.deploy.forward import ForwardedRequest, ResponseStart

    handle = serve.get_deployment_handle("LMServerPrefill", app_name="lmserve").options(
        method_name="forward", stream=True)
    items = list(handle.remote(ForwardedRequest("GET", "/metrics", b"", (), b"")))
    return metric(b"".join(i for i in items if not isinstance(i, ResponseStart)).decode(), name, labels)


def decode_metric(url: str, name: str, labels: str = "") -> float:
    """From the decode replica's /metrics (it is the only engine replica: a GET without a prompt goes there)."""
    return metric(httpx.get(url + "/metrics", timeout=30).text, name, labels)


def shared_hits(url: str) -> float:
    """The decode replica's prompt tokens loaded from the shared tier."""
    return decode_metric(url, "lmserve:kv_offload_hit_tokens_total", 'tier="shared"')


def test_pd_greedy_equals_colocated_on_16_prompts(cluster):
    url, reference, _ = cluster
    cases = [(prompt(i), i % 4 == 3) for i in range(16)]  # every fourth one a chat
    with ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(lambda c: complete(reference.url, c[0], chat=c[1]), cases))
        before = shared_hits(url), decode_metric(url, "lmserve:prefix_cache_hit_tokens_total")
        got = list(pool.map(lambda c: complete(url, c[0], chat=c[1]), cases))
    assert got == expected  # prompt tokens, text and tokens, each prompt
    h = health(url)
    assert h["status"] == "ok" and h["missing_roles"] == [] and h["pd"]["handoffs"] == 16, h
    assert h["pd"]["fallbacks"] == {}
    # decode computed only each prompt's last partial block: every full block came from Redis, or from its own pool
    # for the chat template's system preamble (a block the chats share, loaded by the first chat)
    full = sum((n - 1) // 16 * 16 for n, _ in got)
    assert decode_metric(url, "lmserve:prefix_cache_hit_tokens_total") - before[1] == full
    assert full - 3 * 16 <= shared_hits(url) - before[0] <= full
    short = complete(url, "Short prompts go straight to decode.")
    assert health(url)["pd"]["handoffs"] == 16 and short == complete(reference.url, "Short prompts go straight to decode.")


def test_another_keys_salted_blocks_never_hit(cluster):
    url, reference, srv = cluster
    text = prompt(100)
    n, first = complete(url, text, KEYS[0])
    keys_a = sum(1 for _ in srv.client().scan_iter(match="lmserve:kv:*"))
    # The counters are the replicas' totals since start: the test before this one may have loaded a block from
    # Redis on the prefill replica (the chats' shared preamble, when two chats were in flight at once), so each
    # check is a difference over B's request.
    prefill_hits, decode_hits = prefill_metric("lmserve:prefix_cache_hit_tokens_total"), shared_hits(url)
    prefill_shared = prefill_metric("lmserve:kv_offload_hit_tokens_total", 'tier="shared"')
    _, second = complete(url, text, KEYS[1])  # the same prompt under another key: its own blocks, computed again
    assert second == first == complete(reference.url, text, KEYS[1])[1]
    assert prefill_metric("lmserve:prefix_cache_hit_tokens_total") == prefill_hits  # A's blocks: 0 hit tokens
    assert prefill_metric("lmserve:kv_offload_hit_tokens_total", 'tier="shared"') == prefill_shared  # nor from Redis
    blocks = (n - 1) // 16
    assert shared_hits(url) - decode_hits == blocks * 16  # B's own blocks, written by B's prefill
    assert sum(1 for _ in srv.client().scan_iter(match="lmserve:kv:*")) >= keys_a + n // 16  # B's: new names


def test_a_killed_prefill_replica_falls_back_to_colocated_within_5s(cluster):
    url, reference, _ = cluster
    expected = [complete(reference.url, prompt(200 + i))[1] for i in range(2)]
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith("SERVE_REPLICA::lmserve#LMServerPrefill#")]
    fallbacks = sum(health(url)["pd"]["fallbacks"].values())
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    for i in range(2):  # the first finds the replica dead (or none running), the second skips the role at once
        t0 = time.monotonic()
        assert complete(url, prompt(200 + i))[1] == expected[i]
        assert time.monotonic() - t0 < 5
    h = health(url)
    assert h["status"] == "ok" and h["missing_roles"] == ["prefill"], h
    assert sum(h["pd"]["fallbacks"].values()) == fallbacks + 2

