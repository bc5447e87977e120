"""Hold under abuse, through the real server: overload, a cancellation soak, resource bombs, slow-loris clients, and
a second key probing another's prompts through the prefix cache.

Every test ends by checking that nothing leaked: all KV blocks free, no request in flight (server-wide and per
key), no request running or waiting. The numbers (peak RSS, canary TTFT) are printed, and with
LMSERVE_ABUSE_REPORT=FILE appended to FILE as JSON lines: the README and the closing note quote them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.server_util import MODEL, running_server
from tests.test_media import data_url, image_bytes, png_bomb

# The canaries compare a light client's latency during a bomb with its idle latency, and the soak reads RSS growth:
# a test running beside them in the other worker would move both (scripts/test.sh runs `serial` tests alone)
pytestmark = pytest.mark.serial

C = "/v1/completions"
KEY_FILE = """keys:
  - name: heavy
    key: sk-heavy
    max_concurrent_requests: 3
  - name: light
    key: sk-light
  - name: ops
    key: sk-ops
    role: admin
"""
HEAVY, LIGHT, OPS = ({"Authorization": f"Bearer sk-{k}"} for k in ("heavy", "light", "ops"))  # ops reads /metrics
MB = 2**20


def report(test: str, **numbers) -> None:
    """Print the measured numbers; append them to $LMSERVE_ABUSE_REPORT when set."""
    line = json.dumps({"test": test, **numbers})
    print(line)
    if os.environ.get("LMSERVE_ABUSE_REPORT"):
        with open(os.environ["LMSERVE_ABUSE_REPORT"], "a") as f:
            f.write(line + "\n")


class RssSampler:
    """The server process's peak RSS while the `with` body runs (sampled every 20 ms)."""

    def __init__(self, pid: int) -> None:
        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()

    def __enter__(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(0.02)


def assert_nothing_leaked(server) -> None:
    """Every KV block free, no request in flight (server-wide and per key), none running or waiting."""
    server.wait_idle()
    deadline = time.time() + 10  # a stream's end is counted just after its last byte: allow a moment
    while time.time() < deadline and server.metric("lmserve:num_requests_in_flight") != 0:
        time.sleep(0.05)
    assert server.metric("lmserve:num_requests_in_flight") == 0
    assert server.metric("lmserve:num_requests_running") == 0
    assert server.metric("lmserve:num_requests_waiting") == 0
    for name in ("heavy", "light"):
        assert server.metric("lmserve:key_requests_in_flight", f'key_name="{name}"') == 0
    assert server.metric("lmserve:kv_cache_free_blocks") == server.metric("lmserve:kv_cache_total_blocks")
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    path = tmp_path_factory.mktemp("abuse") / "keys.yaml"
    path.write_text(KEY_FILE)
    with running_server("--api-key-file", str(path), "--max-num-seqs", "4", "--max-queued-requests", "8",
                        "--request-read-timeout", "2", headers=OPS) as s:
        yield s


# -- overload --------------------------------------------------------------------------------------

async def _wave(url: str, n: int, wave: int) -> list[tuple[int, dict, httpx.Headers]]:
    """`n` completions at once, half from each key; (status, body, headers) of each."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as client:
        async def one(i: int):
            body = {"model": MODEL, "prompt": f"Request {wave}.{i}: tell a story", "max_tokens": 16,
                    "ignore_eos": True, "temperature": 0}
            r = await client.post(url + C, json=body, headers=HEAVY if i % 2 else LIGHT)
            return r.status_code, r.json(), r.headers
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_overload_answers_only_200_429_503_and_holds_memory_flat(keyed):
    """10x what the server can hold (4 running + 8 queued = 12): 3 waves of 120 requests at once."""
    capacity, peaks, counts = 4 + 8, [], []
    for wave in range(3):
        with RssSampler(keyed.proc.pid) as rss:
            answers = asyncio.run(_wave(keyed.url, 10 * capacity, wave))
        peaks.append(rss.peak / MB)
        statuses = [status for status, _, _ in answers]
        counts.append({str(code): statuses.count(code) for code in sorted(set(statuses))})
        assert set(statuses) <= {200, 429, 503}, counts[-1]
        for status, body, headers in answers:
            if status == 200:  # admitted: finished in full
                assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"
            else:
                assert int(headers["Retry-After"]) >= 1 and body["error"]["message"]
        assert statuses.count(200) >= capacity // 2  # the server served while refusing the rest
        assert_nothing_leaked(keyed)
    report("overload", requests_per_wave=10 * capacity, answers=counts, peak_rss_mb=[round(p, 1) for p in peaks])
    assert peaks[2] - peaks[0] < 32, peaks  # flat: a third wave costs no more memory than the first


# -- cancellation soak -----------------------------------------------------------------------------

# 600 streams in 10 rounds of 60 (after a 100-stream warm-up). It was 1,000 in 5 rounds of 200 (~195 s of the suite's
# serial phase), then 600 in 4 rounds of 150 and in 6 of 100, then 1,000 in 10 of 100 (325 s on a 2-core Zen 1 at
# load 2.8, RSS flat after the first round; half the serial phase): the judge below needs the ten rounds (arena steps
# land in a few of them), not 100 streams in each. A per-request leak is judged as finely as before (20 KB a
# request: 1.2 MB a round, 6 MB over the last five), and each cancellation mode runs 120 times, as at 600 before (a
# leak that needs one request in 500 to hit it is caught 3 times in 4 instead of 9 in 10 at 1,000). Measured there
# with a leak put in the completions route: 100 KB a request fails it (RSS +5 MB a round); 20 KB a request passed at
# 600 and at 1,000 alike (the heap's free chunks took it: flat, and at 1,000 one 9 MB step in round 9).
SOAK_STREAMS, SOAK_ROUNDS, SOAK_WARM_UP = 600, 10, 100
SOAK_GROWTH_KB = 20  # RSS growth per request that counts as a leak (both readings below)
SHARED = "You are a careful assistant. Answer briefly and precisely. " * 12  # ~130 tokens: prefix-cache hits
MODES = ("before_admission", "prefill", "mid_decode", "at_finish", "complete")


async def _soak_one(client: httpx.AsyncClient, url: str, i: int, rng: random.Random, seen: dict) -> None:
    mode = MODES[i % len(MODES)]
    shared = rng.random() < 0.5
    prompt = (SHARED if shared else f"Unique request {i}: " + "lorem ipsum " * rng.randint(5, 30)) + f" Q{i}?"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(2, 12), "n": rng.choice((1, 1, 2, 3)),
            "stream": True, "temperature": 0.8, "seed": i, "ignore_eos": True}
    seen[mode] = seen.get(mode, 0) + 1
    if mode in ("before_admission", "prefill"):
        task = asyncio.ensure_future(_read_stream(client, url, body, None))
        await asyncio.sleep(rng.uniform(0, 0.004) if mode == "before_admission" else rng.uniform(0.005, 0.08))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    else:
        stop_after = {"mid_decode": rng.randint(1, 6), "at_finish": "finish", "complete": None}[mode]
        await _read_stream(client, url, body, stop_after)


async def _read_stream(client: httpx.AsyncClient, url: str, body: dict, stop_after) -> None:
    """Read an SSE completion; leave (closing the connection) after `stop_after` chunks or the first finish."""
    async with client.stream("POST", url + C, json=body, headers=LIGHT) as r:
        assert r.status_code in (200, 503), r.status_code  # 503: the queue was full at that instant
        chunks, done = 0, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks += 1
                finished = any(c.get("finish_reason") for c in json.loads(line[6:])["choices"])
                if stop_after == chunks or (stop_after == "finish" and finished):
                    return
        assert done or r.status_code == 503


async def _soak(url: str, total: int, seed: int, concurrency: int = 24) -> dict:
    rng, seen, gate = random.Random(seed), {}, asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def gated(i: int):
            async with gate:
                await _soak_one(client, url, i, rng, seen)
        await asyncio.gather(*(gated(i) for i in range(total)))
    return seen


@pytest.mark.slow
def test_cancellation_soak_leaks_no_blocks_no_counters_and_little_memory(tmp_path):
    """600 streams cancelled before admission, in prefill, mid-decode, right at finish (and some read to the end)."""
    path = tmp_path / "keys.yaml"
    path.write_text(KEY_FILE)
    # oneDNN's per-shape caches fill up to their capacity (256 entries each by default, see lmserve/__init__.py):
    # bounded, but they would hide a leak of lmserve's own. With one entry each, growth is lmserve's alone. So for
    # glibc's malloc arenas (up to 8 per core, one per thread that allocates at once): each new or fragmented arena
    # is a 3-6 MB RSS step now and then, bounded but in any round (a Zen 5 CI failed on steps of 3.5, 3.2 and 2.8 MB
    # in 5 rounds; 16 rounds of 100 here stepped 3.0, 5.8 and 3.2 MB, flat between). With 2 arenas the same 16
    # rounds settled by the 6th and stayed flat for 10, under a load of 10: a leak still grows every round.
    pinned = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1", "LRU_CACHE_CAPACITY": "1", "MALLOC_ARENA_MAX": "2"}
    with running_server("--api-key-file", str(path), "--max-num-seqs", "16", "--max-queued-requests", "48",
                        headers=OPS, env=pinned) as s:
        asyncio.run(_soak(s.url, SOAK_WARM_UP, seed=1))  # warm-up: allocator pools, caches, connection buffers
        assert_nothing_leaked(s)
        rss = [psutil.Process(s.proc.pid).memory_info().rss / MB]
        hits_before = s.metric("lmserve:prefix_cache_hit_tokens_total")
        start, seen = time.monotonic(), {}
        for k in range(SOAK_ROUNDS):  # the streams in rounds, RSS read after each
            for mode, count in asyncio.run(_soak(s.url, SOAK_STREAMS // SOAK_ROUNDS, seed=2 + k)).items():
                seen[mode] = seen.get(mode, 0) + count
            assert_nothing_leaked(s)
            rss.append(psutil.Process(s.proc.pid).memory_info().rss / MB)
        seconds = time.monotonic() - start
        hits = s.metric("lmserve:prefix_cache_hit_tokens_total") - hits_before
        aborted = sum(s.metric("lmserve:request_aborts_total", f'reason="{r}"') for r in ("client_disconnect",))
    # A leak grows RSS in every round, the last ones too; the process settling does not: its allocator pools step up
    # by a few MB in some rounds and then stay flat (1,800 streams on a 2-core Zen 5: a 0.7 or 2.8 MB step once, flat
    # for the other 16 rounds), and a busy neighbour (more requests in flight at once) adds a step. So the judge is the
    # two readings, each at 20 KB a request (the old bound's 24 MB / 1,000), and a leak is what passes both: the median
    # growth per round after the first (blind to up to four steps in ten rounds: a Zen 5 CI's six rounds saw three), and the growth over the last half of the rounds
    # (blind to settling that takes several rounds). Either alone took steps for a leak on that host: the median saw
    # [18.8, 3.1, 6.7, 0.0] MB over four rounds of 150 in CI and [6.0, 4.1, 2.1, 0.6, 2.3] over six of 100; the last
    # half would see a late step of ~10 MB. A leak that RSS shows fails both (100 KB a request put in the completions
    # route did); one the heap's free chunks absorb does not show in RSS at all (20 KB a request there, see above).
    growth = [b - a for a, b in zip(rss[1:], rss[2:])]
    half, per_round = SOAK_ROUNDS // 2, SOAK_STREAMS // SOAK_ROUNDS
    steady = statistics.median(growth) * 1024 >= SOAK_GROWTH_KB * per_round
    late = (rss[-1] - rss[-1 - half]) * 1024 >= SOAK_GROWTH_KB * per_round * half
    report("cancellation_soak", requests=SOAK_STREAMS, modes=seen, seconds=round(seconds, 1),
           rss_mb=[round(r, 1) for r in rss], growth_per_round_mb=[round(g, 1) for g in growth],
           prefix_hit_tokens=hits, aborted=aborted)
    # each mode at least 3/4 of its share (150 of 200 before); client-disconnect aborts (the warm-up's included) on at
    # least a fifth of the streams, the prefix-hit bound as before. How many disconnects the engine sees as aborts
    # depends on the CPU's speed: a stream left 0-4 ms after sending may not be a request yet, one left at its finish
    # may be done. The 1,000-stream soak saw 388 of 1,100 and asked for 300; a CI on a 2-core first-generation Zen
    # (2.1 GHz) saw 187 of these 700 (26.7%). A disconnect that no longer aborted would leave ~0.
    assert min(seen.values()) >= 0.75 * SOAK_STREAMS / len(MODES) and hits > 10_000
    assert aborted >= (SOAK_WARM_UP + SOAK_STREAMS) / 5, aborted
    assert not (steady and late), rss


# -- resource bombs, each beside a canary ----------------------------------------------------------

def canary_ttft(url: str, model: str = MODEL) -> float:
    """Seconds to the first token of a short streamed completion (the light key)."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 2, "stream": True, "temperature": 0}
    start = time.monotonic()
    with httpx.stream("POST", url + C, json=body, headers=LIGHT, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.monotonic() - start
    raise AssertionError("the canary got no token")


def _bomb_n_times_max_tokens(url: str) -> tuple[int, str]:
    # the most a request may ask for: n=16 completions of up to the KV pool (it runs, bounded by the pool)
    body = {"model": MODEL, "prompt": "Tell me everything.", "n": 16, "max_tokens": 4000, "ignore_eos": True,
            "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", url + C, json=body, headers=HEAVY, timeout=60) as r:
        for _ in r.iter_lines():
            if time.monotonic() - start > 2:
                break  # it runs (preempting itself as the pool fills); leaving aborts all 16
        return r.status_code, ""


def _post(url: str, path: str = C, **kw) -> tuple[int, str]:
    r = httpx.post(url + path, headers={"Content-Type": "application/json", **HEAVY}, timeout=60, **kw)
    return r.status_code, r.text


def _images(*urls: str) -> dict:
    """A chat request of one user turn holding `urls` as image parts."""
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": u}} for u in urls]}]}


# Encoded once: built in the bomb's thread each time, its 1.2 MB of JSON took this process's GIL from the canary's
# thread, which then timed the test's own encoder as much as the server.
_LOGIT_BIAS_100K = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1,
                               "logit_bias": {str(i): 1 for i in range(100_000)}}).encode()

BOMBS = {
    "n_times_max_tokens": (_bomb_n_times_max_tokens, {200}),
    "logit_bias_100k": (lambda u: _post(u, content=_LOGIT_BIAS_100K), {400}),
    "body_10mb": (lambda u: _post(u, content=b'{"prompt": "' + b"a" * (10 * MB) + b'"}'), {413}),
    "stop_1000": (lambda u: _post(u, json={"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                           "stop": [f"s{i}" for i in range(1000)]}), {400}),
    "json_depth_100k": (lambda u: _post(u, content=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), {400}),
    "n_1000": (lambda u: _post(u, json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "n": 1000}), {400}),
    "prompts_10k": (lambda u: _post(u, json={"model": MODEL, "prompt": ["hi"] * 10_000, "max_tokens": 1}), {400}),
    "regex_explosion": (lambda u: _post(u, json={"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                 "structured_outputs": {"regex": "(a|aa)*" * 2000}}),
                        {400}),
    "schema_explosion": (lambda u: _post(u, json={"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                  "response_format": {"type": "json_schema", "json_schema": {
                                                      "name": "x", "schema": _deep_schema(400)}}}), {400}),
    # images: a PNG declaring 100000x100000 pixels (refused from its header), more images than a request may hold
    "image_decompression_bomb": (lambda u: _post(u, "/v1/chat/completions", json=_images(data_url(png_bomb()))),
                                 {400}),
    "images_1000": (lambda u: _post(u, "/v1/chat/completions", json=_images(*[data_url(image_bytes())] * 1000)),
                    {400}),
}


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_resource_bomb_is_refused_or_bounded_and_the_canary_stays_fast(keyed, name):
    bomb, expected = BOMBS[name]
    idle = statistics.median(canary_ttft(keyed.url) for _ in range(3))
    results, stop = [], threading.Event()

    def fire() -> None:  # the bomb, again and again, while the canary measures
        while not stop.is_set():
            start = time.monotonic()
            status, text = bomb(keyed.url)
            results.append((status, time.monotonic() - start, text))

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    try:
        while not results:  # at least one bomb has landed before the canary starts
            time.sleep(0.01)
        during = statistics.median(canary_ttft(keyed.url) for _ in range(3))
    finally:
        stop.set()
        thread.join(timeout=120)
    report("bomb", name=name, bombs=len(results), bomb_seconds_max=round(max(r[1] for r in results), 3),
           canary_ttft_idle_s=round(idle, 3), canary_ttft_during_s=round(during, 3))
    assert {status for status, _, _ in results} <= expected, results[0]
    assert all("Traceback" not in text for _, _, text in results)
    # bounded: the slowest is a regex or schema refused at the 5 s compile bound, plus the compile process's
    # cold start (~3 s) on the first one: 7.7 and 8.4 s measured on a 2-core Xeon, so 10 s left no margin; a CI on a
    # 2-core first-generation Zen (2.1 GHz) read 20.0 s for the regex bomb, beside the canary's requests
    assert max(seconds for _, seconds, _ in results) < 30
    assert during < 3 * idle + 0.5, (idle, during)  # other clients unaffected (a 2-core box: some contention)
    assert_nothing_leaked(keyed)


LOOPING_TEMPLATE = ("{% for m in messages %}{% for a in m.content %}{% for b in m.content %}{% for c in m.content %}"
                    "{% endfor %}{% endfor %}{% endfor %}{% endfor %}")


def test_a_chat_template_that_loops_is_stopped_and_others_are_served(tmp_path):
    """A model whose chat template loops without end: each chat request is a 400 after the render's time budget."""
    from tests.conftest import write_tiny_llama

    write_tiny_llama(tmp_path / "tiny")
    (tmp_path / "tiny" / "tokenizer_config.json").write_text(json.dumps({"chat_template": LOOPING_TEMPLATE}))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w1 " * 2000}], "max_tokens": 2}
    with running_server("--model", str(tmp_path / "tiny"), "--served-model-name", "tiny") as s:
        idle = canary_ttft(s.url, "tiny")
        with ThreadPoolExecutor(4) as pool:  # four renders at once, each looping until its budget runs out
            bombs = [pool.submit(httpx.post, s.url + "/v1/chat/completions", json=chat, timeout=60) for _ in range(4)]
            time.sleep(0.5)
            during = statistics.median(canary_ttft(s.url, "tiny") for _ in range(3))
            answers = [b.result() for b in bombs]
        report("bomb", name="looping_chat_template", canary_ttft_idle_s=round(idle, 3),
               canary_ttft_during_s=round(during, 3), bomb_seconds_max=round(max(a.elapsed.total_seconds()
                                                                                  for a in answers), 2))
        for a in answers:
            assert a.status_code == 400 and "chat template" in a.json()["error"]["message"], a.text
            assert a.elapsed.total_seconds() < 5 + 5  # the render budget, plus the other renders sharing the GIL
        assert during < 3 * idle + 0.5, (idle, during)
        s.wait_idle()


# -- slow-loris clients ----------------------------------------------------------------------------

def _trickle(port: int, fast: bytes, slow: bytes, gap: float, closed: list) -> None:
    """Send `fast` at once, then `slow` a byte per `gap` seconds; record when the server closed the connection."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as s:
        try:
            s.sendall(fast)
            for byte in slow:
                s.sendall(bytes([byte]))
                time.sleep(gap)
            s.settimeout(10)
            s.recv(1)
        except OSError:
            pass
    closed.append(time.monotonic() - start)


def test_slow_loris_connections_are_closed_and_others_served(keyed):
    """100 clients trickling headers or bodies: each closed at --request-read-timeout (2 s); a canary is served."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-light\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    idle = canary_ttft(keyed.url)
    timed_out = keyed.metric("lmserve:requests_rejected_total", 'reason="read_timeout"')
    closed: list[float] = []
    # odd clients trickle their headers, even ones send headers at once and trickle the body
    threads = [threading.Thread(target=_trickle, args=(keyed.port, b"" if i % 2 else head, head if i % 2 else body,
                                                       0.25, closed), daemon=True) for i in range(100)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    during = statistics.median(canary_ttft(keyed.url) for _ in range(3))
    for t in threads:
        t.join(timeout=30)
    report("slow_loris", clients=100, closed_after_s_max=round(max(closed), 2), canary_ttft_idle_s=round(idle, 3),
           canary_ttft_during_s=round(during, 3))
    assert len(closed) == 100 and max(closed) < 2 + 1.5  # closed at the deadline, long before they would finish
    assert keyed.metric("lmserve:requests_rejected_total", 'reason="read_timeout"') - timed_out == 100
    assert during < 3 * idle + 0.5
    assert_nothing_leaked(keyed)


# -- a second key probing another's prompts ---------------------------------------------------------------------

SECRET_PROMPT = ("Internal memo for the heavy team only: the launch code word is PELICAN-7 and the budget is "
                 "4.2 million; do not share. ") * 8  # ~230 tokens: many KV blocks


async def _probes(url: str, prompts_and_salts: list[tuple[str, str | None]]) -> list[int]:
    """The light key's completions of each prompt at once (never from the response cache); their statuses."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=len(prompts_and_salts))) as client:
        async def one(prompt: str, salt: str | None) -> int:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "cache": False,
                    **({"cache_salt": salt} if salt else {})}
            return (await client.post(url + C, json=body, headers=LIGHT)).status_code
        return await asyncio.gather(*(one(p, s) for p, s in prompts_and_salts))


def test_a_second_key_probing_anothers_prompts_hits_none_of_its_blocks(keyed):
    """The light key replays the heavy key's prompt, guessed prefixes of it, and the salts it might guess for the
    heavy key's blocks, all at once: not one of its prompt tokens comes from the heavy key's KV blocks (each probe
    has its own salt or is sent once, so it cannot hit its own either), while the heavy key's own resend hits. (The
    resend comes before the probes: their ~300 cached blocks exceed the pool's retention budget, an eighth of it,
    so afterwards the heavy key's blocks may have been evicted least-recently-freed first, as designed.)"""
    def hits(name: str) -> float:
        return keyed.metric("lmserve:key_prefix_cache_hit_tokens_total", f'key_name="{name}"')

    heavy_before = hits("heavy")
    for _ in range(2):  # the second send hits the first's blocks: the cache works within the key
        r = httpx.post(keyed.url + C, json={"model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": 1,
                                            "cache": False}, headers=HEAVY, timeout=120)
        assert r.status_code == 200
    assert hits("heavy") - heavy_before >= 128
    light_before = hits("light")
    forged = ["heavy", "key:heavy", "salt:", " ", "\u0000", "default", "anonymous"]  # each used once, on the whole prompt
    cuts = [len(SECRET_PROMPT) * k // 12 for k in range(2, 12)]
    probes = [(SECRET_PROMPT, None)] + [(SECRET_PROMPT, s) for s in forged] + \
             [(SECRET_PROMPT[:cut], f"guess-{cut}") for cut in cuts]
    statuses = asyncio.run(_probes(keyed.url, probes))
    assert set(statuses) <= {200, 503}, statuses  # 503: the queue was full at that instant (nothing learned either)
    assert statuses.count(200) >= len(probes) // 2
    assert hits("light") == light_before, "a probe of the light key was served from the heavy key's blocks"
    assert httpx.get(keyed.url + "/metrics", headers=LIGHT).status_code == 403  # nor may it read the counts
    report("prefix_probe", probes=len(probes), answered=statuses.count(200), light_hit_tokens=hits("light") - light_before)
    assert_nothing_leaked(keyed)
