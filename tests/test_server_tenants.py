"""Named API keys with limits against the real server: 401, 429 per limit kind with OpenAI's headers, settled
token budgets, model allow-lists, per-key metrics, no key anywhere in /metrics or the payload log, and fairness;
and isolation between keys as the holder of a second key would probe it: plain keys each their own identity,
no prefix-cache hits on another key's prompt blocks (unless opted in), /metrics for admin keys only."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import statistics
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from lmserve.server.key_file import plain_name
from tests.server_util import BASE_ARGS, MODEL, free_port, running_server

C = "/v1/completions"
KEYS = {name: f"sk-{name}-0123456789abcdef" for name in ("rpm", "tpm", "conc", "nomodel", "hashed", "open")}
PLAIN = "plain-key-fedcba9876543210"
KEY_FILE = f"""
keys:
  - name: rpm
    key: {KEYS["rpm"]}
    requests_per_minute: 2
  - name: tpm
    key: {KEYS["tpm"]}
    tokens_per_minute: 60          # a prompt of a few tokens + max_tokens 20 fits twice, not three times
  - name: conc
    key: {KEYS["conc"]}
    max_concurrent_requests: 1
  - name: nomodel
    key: {KEYS["nomodel"]}
    models: [some-other-model]
  - name: hashed
    sha256: {hashlib.sha256(KEYS["hashed"].encode()).hexdigest()}
  - name: open
    key: {KEYS["open"]}
    requests_per_minute: 1000
    tokens_per_minute: 100000
    role: admin                    # reads /metrics
"""


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    (tmp / "keys.yaml").write_text(KEY_FILE)
    with running_server("--api-key-file", str(tmp / "keys.yaml"), "--api-key", PLAIN, "--max-num-seqs", "2",
                        "--payload-log", str(tmp / "payload.jsonl"), headers=auth("open")) as s:
        s.payload_log = tmp / "payload.jsonl"
        yield s


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def client(server, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS.get(name, name), max_retries=0)


def complete(server, name: str, max_tokens: int = 4, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens, "temperature": 0, **kw}
    return httpx.post(server.url + C, json=body, headers=auth(name), timeout=60)


def test_wrong_or_missing_key_is_401_and_every_key_kind_works(keyed):
    for key in ("wrong", KEYS["rpm"] + "x", "sk-hashed", hashlib.sha256(KEYS["hashed"].encode()).hexdigest()):
        with pytest.raises(openai.AuthenticationError):
            client(keyed, key).models.list()
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    for key in (KEYS["hashed"], PLAIN, KEYS["open"]):
        assert [m.id for m in client(keyed, key).models.list()] == [MODEL]


def test_requests_per_minute_429_with_retry_after_and_headers(keyed):
    seen = []
    for _ in range(2):
        r = complete(keyed, "rpm")
        assert r.status_code == 200
        seen.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert r.headers["x-ratelimit-limit-requests"] == "2" and "x-ratelimit-limit-tokens" not in r.headers
    assert seen == [1, 0]  # remaining counts down (one request refills every 30 s)
    r = complete(keyed, "rpm")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 25 <= int(r.headers["Retry-After"]) <= 30
    assert r.headers["x-ratelimit-remaining-requests"] == "0" and r.headers["x-ratelimit-reset-requests"][-1] == "s"
    with pytest.raises(openai.RateLimitError, match="2 requests per minute"):
        client(keyed, "rpm").completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert keyed.metric("lmserve:key_rejections_total", 'key_name="rpm",reason="requests_per_minute"') == 2
    assert keyed.metric("lmserve:key_requests_total", 'key_name="rpm"') == 2


def test_tokens_reserved_at_admission_and_settled_to_usage(keyed):
    c = client(keyed, "tpm")
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=20, temperature=0,
                                                 stop=["-", " ", "\n"])  # greedy "Hi" goes "-and-go-to-..."
    r = raw.parse()
    used = r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.completion_tokens < 20  # a stop ended it early: the rest of the reservation comes back
    remaining = int(raw.headers["x-ratelimit-remaining-tokens"])  # read before settling: the reservation is out
    assert remaining <= 60 - r.usage.prompt_tokens - 20 + 1
    after = int(httpx.get(keyed.url + "/v1/models", headers=auth("tpm")).headers["x-ratelimit-remaining-tokens"])
    assert 60 - used <= after <= 60 - used + 2  # settled to what was used (plus a second's refill)
    with pytest.raises(openai.RateLimitError, match="lower max_tokens") as e:
        c.completions.create(model=MODEL, prompt="Hi", max_tokens=60)  # with the prompt, larger than the whole minute's budget
    assert "Retry-After" not in e.value.response.headers
    assert keyed.metric("lmserve:key_tokens_total", 'key_name="tpm",kind="completion"') == r.usage.completion_tokens
    ok = 0
    while (r := complete(keyed, "tpm", max_tokens=25, ignore_eos=True)).status_code == 200:
        ok += 1
    assert ok >= 1 and r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.headers["x-ratelimit-limit-tokens"] == "60"


def test_concurrency_limit_counts_until_the_stream_ends(keyed):
    body = {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", keyed.url + C, json=body, headers=auth("conc"), timeout=60) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        next(lines)
        with pytest.raises(openai.RateLimitError, match="1 concurrent"):
            client(keyed, "conc").completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        assert complete(keyed, "open").status_code == 200  # other keys are not held up
    keyed.wait_idle()
    assert complete(keyed, "conc").status_code == 200


def test_model_allow_list_is_404_model_not_found(keyed):
    c = client(keyed, "nomodel")
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert e.value.code == "model_not_found" and "do not have access" in e.value.message
    assert c.models.list().data == []  # a key sees only its models
    r = httpx.post(keyed.url + "/generate", json={"inputs": "Hi"}, headers=auth("nomodel"))
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"  # TGI routes too, in TGI's shape
    assert keyed.metric("lmserve:key_rejections_total", 'key_name="nomodel",reason="model"') == 2


def test_stream_carries_rate_limit_headers(keyed):
    # a reservation far above the bucket's refill between admission and the headers (100000 a minute is 1.7 a
    # millisecond: a reservation of 3 tokens was refilled before the headers went out on a loaded machine)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", keyed.url + C, json=body, headers=auth("open"), timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-ratelimit-limit-tokens"] == "100000"
        # the reservation already taken (less what refilled since: 1500 tokens would take 0.9 s)
        assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 100000 - 1500
        next(r.iter_lines())  # leaving now aborts the rest
    keyed.wait_idle()


def test_keys_never_appear_in_metrics_or_payload_log_but_names_do(keyed):
    for name in ("open", "hashed"):
        assert complete(keyed, name).status_code == 200
    keyed.wait_idle()
    metrics = httpx.get(keyed.url + "/metrics", headers=auth("open")).text
    for secret in (*KEYS.values(), PLAIN):
        assert secret not in metrics
    names = {line.split('key_name="')[1].split('"')[0] for line in metrics.splitlines() if 'key_name="' in line}
    # the closed set from the file, and the plain key's label (neither the key nor its fingerprint)
    assert names == {"rpm", "tpm", "conc", "nomodel", "hashed", "open", "plain-1"}
    assert plain_name(PLAIN) not in metrics
    deadline = time.time() + 10
    while time.time() < deadline and '"key_name": "hashed"' not in keyed.payload_log.read_text():
        time.sleep(0.1)
    log = keyed.payload_log.read_text()
    lines = [json.loads(line) for line in log.splitlines()]
    assert {"open", "hashed", "rpm"} <= {line["key_name"] for line in lines}
    for secret in (*KEYS.values(), PLAIN, "Bearer", "uthorization"):
        assert secret not in log


def test_bad_key_file_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - name: a\n    key: sk-never-printed-123\n    requests_per_minit: 3\n")
    p = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(free_port()), "--api-key-file", str(path), *BASE_ARGS],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "keys[0] (a): unknown field 'requests_per_minit'" in p.stderr and "sk-never" not in p.stderr


# -- isolation between keys, probed with a second key --------------------------------------------------------

ISO_KEYS = {name: f"sk-iso-{name}-0123456789" for name in ("team-a", "team-b", "shared-1", "shared-2", "ops")}
P1, P2 = "plain-one-0123456789", "plain-two-0123456789"
PLAIN_LABELS = {P1: "plain-1", P2: "plain-2"}  # /metrics's names for them, in the order they are given
# ~200 tokens: several full KV blocks, so a hit (or its absence) is many tokens, not a rounding
DOCUMENT = "The quarterly report of {who} lists revenue, costs and the plans for next year in detail. " * 12


@pytest.fixture(scope="module")
def isolated(tmp_path_factory):
    """Two isolated keys (the default), two that opt in to a shared prefix cache, an admin, and two plain keys;
    a response cache, the playground and batch jobs on, each in this test's own files."""
    tmp = tmp_path_factory.mktemp("isolation")
    (tmp / "keys.yaml").write_text("keys:\n" + "".join(
        f"  - {{name: {name}, key: {key}{', prefix_cache: shared' if name.startswith('shared') else ''}"
        f"{', role: admin' if name == 'ops' else ''}}}\n" for name, key in ISO_KEYS.items()))
    with running_server("--api-key-file", str(tmp / "keys.yaml"), "--api-key", P1, "--api-key", P2,
                        "--response-cache", f"sqlite:{tmp / 'responses.sqlite'}", "--batch-dir", str(tmp / "batches"),
                        "--playground-db", str(tmp / "shares.db"),
                        headers={"Authorization": f"Bearer {ISO_KEYS['ops']}"}) as s:
        yield s


def iso(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=ISO_KEYS.get(key, key), max_retries=0, timeout=120)


def prefix_hits(server, key: str) -> float:
    name = key if key in ISO_KEYS else PLAIN_LABELS[key]
    return server.metric("lmserve:key_prefix_cache_hit_tokens_total", f'key_name="{name}"')


def send(server, key: str, prompt: str, **extra) -> float:
    """One completion of `prompt` (never from the response cache); returns the prefix-cache tokens it hit."""
    before = prefix_hits(server, key)
    iso(server, key).completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                        extra_body={"cache": False, **extra})
    return prefix_hits(server, key) - before


def test_one_keys_prompt_never_hits_another_keys_prefix_blocks(isolated):
    """The issue's fifth finding: B resent A's 1,400-word prompt and was answered from A's KV blocks (0.05 s
    against 2.4 s), so B could confirm A's prompts or guessed prefixes of them. Asserted by hit tokens, not time."""
    doc = DOCUMENT.format(who="ACME Corp (confidential)")
    assert send(isolated, "team-a", doc) == 0
    assert send(isolated, "team-b", doc) == 0  # A's blocks are there, but not B's to hit
    assert send(isolated, P1, doc[: len(doc) // 2]) == 0  # nor a guessed prefix's (a plain key is a tenant too)
    a_again = send(isolated, "team-a", doc)
    assert a_again >= 128  # A's own prompt hits A's own blocks: the cache still works within a key
    assert send(isolated, "team-b", doc) >= 128  # and B's blocks, from its own first send, are B's


def test_sharing_prefix_blocks_is_opt_in_by_key_or_cache_salt(isolated):
    """`prefix_cache: shared` keys share one pool (a common system prompt); a request's `cache_salt` shares with
    requests sending the same salt, whatever their key; an isolated key reaches neither."""
    doc = DOCUMENT.format(who="the shared system prompt")
    assert send(isolated, "shared-1", doc) == 0
    assert send(isolated, "shared-2", doc) >= 128  # opted in: the other shared key's blocks
    assert send(isolated, "team-a", doc) == 0  # not opted in: the shared pool is not its
    salted = DOCUMENT.format(who="the team's common preamble")
    assert send(isolated, "team-a", salted, cache_salt="preamble-v1") == 0
    assert send(isolated, "team-b", salted, cache_salt="preamble-v1") >= 128  # the same salt: shared
    assert send(isolated, "team-b", salted, cache_salt="preamble-v2") == 0  # another salt: not
    assert send(isolated, "shared-1", salted) == 0  # without the salt, nothing salted is reachable
    total = isolated.metric("lmserve:prefix_cache_hit_tokens_total")
    assert total >= sum(prefix_hits(isolated, k) for k in ISO_KEYS)  # the per-key counts add up under the total


def test_every_plain_key_is_its_own_identity(isolated):
    """The issue's fourth finding: with --api-key K1 --api-key K2, K2 got K1's cached answers and listed, read and
    deleted K1's shares, batches and files."""
    one, two = iso(isolated, P1), iso(isolated, P2)
    ask = dict(model=MODEL, prompt="Plain keys are tenants too:", max_tokens=4, temperature=0)
    assert one.completions.with_raw_response.create(**ask).headers["x-lmserve-cache"] == "miss"
    assert two.completions.with_raw_response.create(**ask).headers["x-lmserve-cache"] == "miss"  # not K1's entry
    assert two.completions.with_raw_response.create(**ask).headers["x-lmserve-cache"] == "hit"  # its own
    share = {"mode": "completion", "model": MODEL, "prompt": "K1's private prompt", "params": {},
             "output": {"text": "K1's private answer"}}
    h1, h2 = ({"Authorization": f"Bearer {k}"} for k in (P1, P2))
    made = httpx.post(isolated.url + "/playground/api/shares", json=share, headers=h1, timeout=30).json()
    assert httpx.get(isolated.url + "/playground/api/shares", headers=h2, timeout=30).json()["data"] == []
    assert httpx.delete(isolated.url + f"/playground/api/shares/{made['id']}", headers=h2, timeout=30).status_code == 404
    line = {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "hi",
                                                                                     "max_tokens": 1}}
    uploaded = one.files.create(file=("in.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = one.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert list(two.batches.list()) == []
    for attempt in (lambda: two.files.retrieve(uploaded.id), lambda: two.files.content(uploaded.id),
                    lambda: two.files.delete(uploaded.id), lambda: two.batches.retrieve(batch.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert one.files.retrieve(uploaded.id).id == uploaded.id  # still there for its owner
    for key in (P1, P2):  # each counted under its own label (a cache hit is not admitted: not counted)
        assert isolated.metric("lmserve:key_requests_total", f'key_name="{PLAIN_LABELS[key]}"') >= 1


def test_metrics_is_for_admin_keys_only(isolated):
    """The issue's seventh finding: /metrics, which lists every key name and its usage, was readable with any key.
    Issue 47's eleventh: it named each plain key `key-` + 8 hex digits of its SHA-256, so a reader could test
    guesses of a weak key offline; now only the key file's names and `plain-N` labels appear."""
    for key in ("team-a", "shared-1", P1, P2):
        r = httpx.get(isolated.url + "/metrics", headers={"Authorization": f"Bearer {ISO_KEYS.get(key, key)}"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", (key, r.text)
        assert "key_name" not in r.text
    assert httpx.get(isolated.url + "/metrics").status_code == 401
    iso(isolated, P2).completions.create(model=MODEL, prompt="Count me", max_tokens=1, extra_body={"cache": False})
    ok = httpx.get(isolated.url + "/metrics", headers={"Authorization": f"Bearer {ISO_KEYS['ops']}"})
    assert ok.status_code == 200
    names = set(re.findall(r'key_name="([^"]*)"', ok.text))
    assert names == set(ISO_KEYS) | {"plain-1", "plain-2"}, names
    assert not re.search(r"key-[0-9a-f]{8}", ok.text) and plain_name(P2) not in ok.text
    assert isolated.metric("lmserve:key_requests_total", 'key_name="plain-2"') >= 1


# -- fairness ------------------------------------------------------------------------------------------


def ttft(url: str, key: str) -> float:
    """Seconds until the first streamed token of a short request."""
    body = {"model": MODEL, "prompt": "Name a colour.", "max_tokens": 2, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + C, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise AssertionError("no token streamed")


def paced_ttft(url: str, key: str) -> float:
    """TTFT of a light user's request sent after a pause, idle and busy alike. Without the pause B's next request
    would land exactly when its last one frees a slot, i.e. in the step where A's preempted request is
    recomputed (a prefill of its whole prompt and output so far), and measure that recompute, not fairness."""
    time.sleep(0.4)
    return ttft(url, key)


def flood(url: str, key: str, n: int, done: threading.Event) -> None:
    """n concurrent long requests of one key, until they finish or `done` is set."""
    async def run():
        async with httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {key}"}) as ac:
            body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 200,
                    "ignore_eos": True}
            tasks = [asyncio.ensure_future(ac.post(url + C, json=body)) for _ in range(n)]
            while not done.is_set() and not all(t.done() for t in tasks):
                await asyncio.sleep(0.05)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


@pytest.mark.slow
@pytest.mark.serial  # B's TTFT is compared with its own idle TTFT: a test in the other worker moves one but not the other
def test_a_busy_key_does_not_starve_a_light_one(tmp_path):
    """B's TTFT p50 with A's 20 concurrent long requests stays within 2x of B's TTFT on an idle server."""
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - {name: team-a, key: sk-team-a-0123456789}\n  - {name: team-b, key: sk-team-b-0123456789}\n"
                    "  - {name: ops, key: sk-ops-0123456789, role: admin}\n")  # ops reads /metrics
    with running_server("--api-key-file", str(path), "--max-num-seqs", "2",
                        headers={"Authorization": "Bearer sk-ops-0123456789"}) as s:
        ttft(s.url, "sk-team-b-0123456789")  # first request: warm caches
        idle = statistics.median(paced_ttft(s.url, "sk-team-b-0123456789") for _ in range(7))
        done = threading.Event()
        a = threading.Thread(target=flood, args=(s.url, "sk-team-a-0123456789", 20, done))
        a.start()
        try:
            s.wait_for_running(20)
            time.sleep(0.5)  # two of A's are decoding, eighteen wait
            busy = statistics.median(paced_ttft(s.url, "sk-team-b-0123456789") for _ in range(7))
            # FCFS would also pass on the median alone: B's first request would wait behind all of A's, and
            # the rest would find the server idle. So A must still be queueing once B is done.
            waiting = s.metric("lmserve:num_requests_waiting")
        finally:
            done.set()
            a.join()
        print(f"team-b TTFT p50: idle {idle * 1000:.0f} ms, with team-a's 20 long requests {busy * 1000:.0f} ms")
        assert waiting >= 10  # A's requests really were queued while B was measured
        assert busy <= 2 * idle, (idle, busy)
