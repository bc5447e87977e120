"""The response cache: keys, both backends (SQLite, a real redis-server), and the real server through the openai client."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import httpx
import openai
import pytest

from lmserve.loader.fingerprint import weights_fingerprint
from lmserve.server.protocol import ChatRequest, CompletionRequest, answer_neutral
from lmserve.server.response_cache import CacheSettings, cache_key, cacheable, open_backend
from tests.server_util import MODEL, free_port, running_server

KEYS = """keys:
  - name: alice
    key: sk-alice
  - name: bob
    key: sk-bob
  - name: ops
    key: sk-ops
    role: admin
"""


@pytest.fixture(scope="module")
def redis_url():
    """A real redis-server on a free loopback port, no persistence; skipped (naming the package) without it."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian package redis-server; scripts/install.sh test installs it)")
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0", proc
    proc.kill()
    proc.wait()


def test_only_deterministic_requests_are_cacheable():
    assert cacheable({"temperature": 0}) and cacheable({"temperature": 0.8, "seed": 3})
    assert not cacheable({}) and not cacheable({"temperature": 0.7})  # OpenAI's default temperature is 1
    assert not cacheable({"temperature": 0, "cache": False})
    # an image fetched by URL is not in the body (a data: URL is): OpenAI chat, Responses, Anthropic
    url, inline = "https://images.example/cat.png", "data:image/png;base64,AAAA"
    for image in ({"type": "image_url", "image_url": {"url": url}}, {"type": "image_url", "image_url": url},
                  {"type": "input_image", "image_url": url}, {"type": "image", "source": {"type": "url", "url": url}}):
        for field in ("messages", "input"):
            assert not cacheable({"temperature": 0, field: [{"role": "user", "content": [image]}]})
    assert cacheable({"temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": inline}}]}]})


def test_key_ignores_delivery_fields_and_separates_keys_models_and_routes():
    body = {"prompt": "hi", "temperature": 0, "max_tokens": 4}
    neutral = answer_neutral(CompletionRequest)  # the fields the protocol marks as not changing the answer
    k = cache_key("m", "alice", "/v1/completions", body, neutral)
    assert k == cache_key("m", "alice", "/v1/completions", {"max_tokens": 4, "temperature": 0, "prompt": "hi",
                                                            "stream": True, "user": "u", "cache": True,
                                                            "cache_salt": "s"}, neutral)
    assert neutral == answer_neutral(ChatRequest) and not neutral & {"temperature", "seed", "max_tokens"}
    assert len({k, cache_key("m", "bob", "/v1/completions", body), cache_key("m2", "alice", "/v1/completions", body),
                cache_key("m", "alice", "/v1/chat/completions", body),
                cache_key("m", "alice", "/v1/completions", {**body, "max_tokens": 5})}) == 5


def test_weights_fingerprint_follows_the_weights(tmp_path):
    """What answers is part of the key: the same bytes give the same fingerprint (a restart hits), other weights
    under the same file name or directory another (a swapped checkpoint never answers from the old one's entries)."""
    import os

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 8000)
    first = weights_fingerprint(gguf)
    assert weights_fingerprint(gguf) == first
    os.utime(gguf, ns=(1, 1))  # touched (a copy, a re-download): another file as far as the cache can tell
    assert weights_fingerprint(gguf) != first
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 4096)
    before = weights_fingerprint(d)
    stat = (d / "model.safetensors").stat()
    (d / "model.safetensors").write_bytes(b"\1" * 4096)  # same size, same mtime: only the bytes differ
    os.utime(d / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_fingerprint(d) != before


def _backends(tmp_path, redis_url, ttl=60.0, max_entries=3):
    return [open_backend(CacheSettings(f"sqlite:{tmp_path / 'c.sqlite'}", ttl, max_entries)),
            open_backend(CacheSettings(redis_url[0], ttl, max_entries))]


def test_backends_store_expire_and_evict_the_oldest(tmp_path, redis_url):
    import redis

    redis.Redis.from_url(redis_url[0]).flushdb()
    for backend in _backends(tmp_path, redis_url):
        for i in range(5):
            backend.put(f"k{i}", b"v%d" % i)
            time.sleep(0.01)
        assert backend.count() == 3 and backend.get("k0") is None and backend.get("k1") is None
        assert backend.get("k4") == b"v4"
    for backend in _backends(tmp_path / "short", redis_url, ttl=0.3):
        backend.put("x", b"1")
        assert backend.get("x") == b"1"
        time.sleep(0.5)
        assert backend.get("x") is None and backend.count() == 0


def test_a_key_at_its_share_evicts_only_its_own_entries(tmp_path, redis_url):
    """Issue 47: one key's flood evicted every key's entries. Each backend, 6 entries with shares of 2 per key."""
    import redis

    redis.Redis.from_url(redis_url[0]).flushdb()
    for backend in _backends(tmp_path, redis_url, max_entries=6):
        for i in range(2):
            backend.put(f"b{i}", b"team-b", "team-b", 2)
        for i in range(10):
            backend.put(f"a{i}", b"team-a", "team-a", 2)
            time.sleep(0.002)
        assert [backend.get(k) for k in ("b0", "b1", "a8", "a9")] == [b"team-b"] * 2 + [b"team-a"] * 2
        assert backend.get("a7") is None and backend.count() == 4
        for i in range(6):  # a key without a cap still fills the cache, and the oldest of all go past its size
            backend.put(f"c{i}", b"open", "open")
        assert backend.count() == 6 and backend.get("b0") is None and backend.get("c5") == b"open"


def test_bad_cache_url_is_one_line_and_exit_2():
    p = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(free_port()), "--response-cache", "memcached://x"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--response-cache must be" in p.stderr and "Traceback" not in p.stderr


def client(server, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def cached(tmp_path_factory, redis_url):
    tmp = tmp_path_factory.mktemp("cache")
    (tmp / "keys.yaml").write_text(KEYS)
    with running_server("--api-key-file", str(tmp / "keys.yaml"), "--response-cache", redis_url[0],
                        "--response-cache-ttl", "30", headers={"Authorization": "Bearer sk-ops"}) as s:
        yield s


def _completion(server, key="sk-alice", **kw):
    return client(server, key).completions.with_raw_response.create(
        model=MODEL, prompt=kw.pop("prompt", "The capital of France is"), max_tokens=8, temperature=0, **kw)


def test_miss_then_hit_same_answer_and_usage(cached):
    first = _completion(cached, prompt="Name a colour:")
    second = _completion(cached, prompt="Name a colour:")
    assert first.headers["x-lmserve-cache"] == "miss" and second.headers["x-lmserve-cache"] == "hit"
    a, b = first.parse(), second.parse()
    assert a.choices[0].text == b.choices[0].text and a.usage == b.usage and a.id != b.id
    assert cached.metric("lmserve:response_cache_hits_total") >= 1
    assert cached.metric("lmserve:response_cache_entries") >= 1


def test_chat_hit_replayed_as_a_stream(cached):
    c = client(cached)
    messages = [{"role": "user", "content": "Say hello."}]
    whole = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8, seed=7)
    assert whole.headers["x-lmserve-cache"] == "miss"
    stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=7, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.parse().choices[0].message.content
    assert chunks[-1].usage == whole.parse().usage
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.parse().choices[0].finish_reason
    with httpx.stream("POST", cached.url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-alice"},
                      json={"model": MODEL, "messages": messages, "max_tokens": 8, "seed": 7, "stream": True}) as r:
        assert r.headers["x-lmserve-cache"] == "hit" and list(r.iter_lines())[-2] == "data: [DONE]"


def test_bypass_by_body_header_or_sampling(cached):
    _completion(cached, prompt="Bypass me")
    assert _completion(cached, prompt="Bypass me", extra_body={"cache": False}).headers["x-lmserve-cache"] == "bypass"
    assert _completion(cached, prompt="Bypass me",
                       extra_headers={"Cache-Control": "no-cache"}).headers["x-lmserve-cache"] == "bypass"
    sampled = [client(cached).completions.with_raw_response.create(model=MODEL, prompt="Sampled", max_tokens=4)
               for _ in range(2)]
    assert [r.headers["x-lmserve-cache"] for r in sampled] == ["bypass", "bypass"]


def test_entries_are_never_shared_across_api_keys(cached):
    assert _completion(cached, prompt="Per key").headers["x-lmserve-cache"] == "miss"
    assert _completion(cached, "sk-bob", prompt="Per key").headers["x-lmserve-cache"] == "miss"
    assert _completion(cached, "sk-bob", prompt="Per key").headers["x-lmserve-cache"] == "hit"


def test_redis_down_serves_from_the_model(tmp_path):
    """A cache that cannot be reached: every request is a 200 from the model (a miss), the server stays healthy."""
    port = free_port()
    (tmp_path / "keys.yaml").write_text(KEYS)
    with running_server("--response-cache", f"redis://127.0.0.1:{port}/0") as s:
        for _ in range(2):
            r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                              "temperature": 0}, timeout=60)
            assert r.status_code == 200 and r.headers["x-lmserve-cache"] == "miss"
        assert httpx.get(s.url + "/health").status_code == 200
        assert s.metric("lmserve:response_cache_misses_total") == 2


def test_sqlite_cache_survives_a_restart(tmp_path):
    body = {"model": MODEL, "prompt": "Remember me", "max_tokens": 4, "temperature": 0}
    answers = []
    for _ in range(2):
        with running_server("--response-cache", f"sqlite:{tmp_path / 'cache.sqlite'}") as s:
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            answers.append((r.headers["x-lmserve-cache"], r.json()["choices"][0]["text"]))
    assert [a[0] for a in answers] == ["miss", "hit"] and answers[0][1] == answers[1][1]
