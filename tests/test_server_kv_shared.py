"""The shared KV tier on real servers: two replicas (A and B) on one real redis-server, or on one directory. A
~480-token prompt computed on A is answered by B from the shared store with the same greedy tokens and logprobs,
B's prefill skipped for the shared blocks; for its own API key alone; a corrupt block is refused and recomputed;
Redis killed mid-run turns the tier into misses, every request still answered. Hits asserted from /metrics."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from lmserve.cache.kv_disk import HEADER
from lmserve.cache.kv_redis import SECRET_KEY
from tests.redis_server import redis_server
from tests.server_util import running_server

KEYS = ("sk-share-a-0123456789abcdef", "sk-share-b-0123456789abcdef")
HEADERS = {"Authorization": f"Bearer {KEYS[0]}"}
WORDS = ("A long system prompt sets out the house rules: answer briefly, cite the manual, never guess a part "
         "number, and say which warehouse ships each order before quoting a delivery date. ").split()


# Long enough for what a long prompt exercises: 30 full blocks, prefilled in 4 chunks (STEP tokens a step, fixed
# below so every host chunks alike: the fitted default could take a short prompt in one step). It was ~1,500 tokens
# (94 blocks) at the fitted budget: 2-3 chunks on a 2-core host, ~190 s for the two tests there, mostly prefill.
WORDS_PER_PROMPT, STEP = 400, 128


def prompt(first: str, words: int = WORDS_PER_PROMPT) -> str:
    """About 480 tokens; prompts with other first words share no block."""
    return first + " " + " ".join(WORDS[i % len(WORDS)] for i in range(words))


def complete(server, key: str, text: str) -> tuple[int, list]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=300)
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=text, max_tokens=8, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    return r.usage.prompt_tokens, [r.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs]


def shared(server, name: str) -> float:
    return server.metric(f"lmserve:kv_offload_{name}", 'tier="shared"')


def wait_stores(server, n: int) -> None:
    deadline = time.time() + 120  # the writer thread's queue drains; a bound, not a measurement
    while shared(server, "stores_total") < n and time.time() < deadline:
        time.sleep(0.2)
    assert shared(server, "stores_total") >= n


def args(store: str) -> tuple[str, ...]:
    return ("--kv-shared", store, "--api-key", KEYS[0], "--api-key", KEYS[1], "--metrics-public",
            "--max-num-batched-tokens", str(STEP))


def assert_served_to_b(a, b) -> int:
    """A long prompt computed on A is loaded by B for A's key alone, with A's tokens; returns its length."""
    n, cold = complete(a, KEYS[0], prompt("First:"))
    assert 3 * STEP < n <= 4 * STEP  # 4 chunks
    wait_stores(a, n // 16)
    complete(b, KEYS[1], prompt("First:"))  # another key: none of A's blocks
    assert shared(b, "hit_tokens_total") == 0 and b.metric("lmserve:prefix_cache_hit_tokens_total") == 0
    _, again = complete(b, KEYS[0], prompt("First:"))
    hit = (n - 1) // 16 * 16  # every full block: B's prefill ran the last token only
    assert shared(b, "hit_tokens_total") == hit and shared(b, "loads_total") == hit // 16
    assert b.metric("lmserve:prefix_cache_hit_tokens_total") == hit
    assert again == cold  # text, tokens, logprobs and top logprobs: the loaded KV is the computed KV
    assert b.metric("lmserve:kv_shared_read_seconds_count") >= hit // 16
    assert b.metric("lmserve:kv_shared_read_seconds_sum") > 0 and shared(b, "load_bytes_total") > 0
    return n


def test_two_replicas_share_a_long_prompt_through_redis():
    with redis_server() as srv, running_server(*args(srv.url), headers=HEADERS) as a, \
            running_server(*args(srv.url), headers=HEADERS) as b:
        assert_served_to_b(a, b)
        assert b.metric("lmserve:kv_shared_rejected_blocks_total") == 0

        n, cold = complete(a, KEYS[0], prompt("Second:"))  # then every value in Redis gets a flipped last byte
        wait_stores(a, n // 16)
        redis = srv.client()
        for key in redis.scan_iter(match="lmserve:kv:*"):
            if key != SECRET_KEY.encode():
                value = bytearray(redis.get(key))
                value[-1] ^= 0xFF
                redis.set(key, bytes(value))
        hits = shared(b, "hit_tokens_total")
        _, again = complete(b, KEYS[0], prompt("Second:"))
        assert again == cold and shared(b, "hit_tokens_total") == hits  # recomputed, never served
        assert b.metric("lmserve:kv_shared_rejected_blocks_total") >= 1

        srv.kill()  # Redis gone mid-run: misses, logged and counted, and every request answered
        for server in (b, a):
            n, out = complete(server, KEYS[0], prompt("Third:"))
            assert n > 3 * STEP and len(out[1]) == 8
        assert b.metric("lmserve:kv_shared_errors_total") >= 1
        assert a.metric("lmserve:kv_shared_errors_total") >= 1
        assert all(httpx.get(s.url + "/health", timeout=10).status_code == 200 for s in (a, b))


def test_two_replicas_share_a_long_prompt_through_one_directory(tmp_path):
    kv = tmp_path / "kv"
    with running_server(*args(str(kv)), headers=HEADERS) as a, running_server(*args(str(kv)), headers=HEADERS) as b:
        assert_served_to_b(a, b)
        before = set(kv.rglob("*.kvb"))
        n, cold = complete(a, KEYS[0], prompt("Second:"))
        wait_stores(a, n // 16)
        for path in set(kv.rglob("*.kvb")) - before:  # the new prompt's files, each with a flipped last byte
            raw = bytearray(path.read_bytes())
            assert len(raw) > HEADER.size
            raw[-1] ^= 0xFF
            path.write_bytes(bytes(raw))
        hits = shared(b, "hit_tokens_total")
        _, again = complete(b, KEYS[0], prompt("Second:"))
        assert again == cold and shared(b, "hit_tokens_total") == hits
        assert b.metric("lmserve:kv_shared_rejected_blocks_total") >= 1


@pytest.mark.parametrize("store, error", [("redis://127.0.0.1:notaport/0", "--kv-shared: not a Redis URL"),
                                          ("/proc/lmserve-kv", "--kv-shared /proc/lmserve-kv: cannot write there")])
def test_a_bad_kv_shared_is_a_one_line_error(store, error):
    import subprocess
    import sys

    from tests.server_util import free_port

    p = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(free_port()), "--kv-shared", store],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and error in p.stderr and "Traceback" not in p.stderr
