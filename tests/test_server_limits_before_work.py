"""Limits before work (issue 47, finding 4), as the holder of a rate-limited key would attack: 4 MiB prompts in a
row, every route that does work called past the key's rate, and a prompt past the key's tokens per minute.

The key's request is taken before the body is parsed or tokenized, so a prompt refused for its length still
counts; a prompt's size and token quota are checked by its byte bounds (tokenizer/bounds.py) before it is
tokenized; tokenizing a long prompt never holds the event loop (a short one is done there: cheaper than a thread
hop); the heap goes back after a large request.
"""

from __future__ import annotations

import random
import threading
import time

import anthropic
import httpx
import openai
import pytest

from tests.server_util import MODEL, running_server

KEYS = {name: f"sk-{name}-0123456789abcdef" for name in
        ("big", "tok", "detok", "count", "files", "share", "tpm", "admin")}
KEY_FILE = "keys:\n" + "".join(f"  - name: {name}\n    key: {key}\n" + {
    "big": "    requests_per_minute: 5\n",
    "tpm": "    tokens_per_minute: 2000\n",
    "admin": "    role: admin\n",
}.get(name, "    requests_per_minute: 1\n") for name, key in KEYS.items())
# A prompt as large as the 4 MiB body limit allows: 699,011 tokens, whose tokenizing took 6-11 s on the event loop.
HUGE = "hello world " * ((4 * 2**20 - 200) // 12)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    (tmp / "keys.yaml").write_text(KEY_FILE)
    with running_server("--api-key-file", str(tmp / "keys.yaml"), headers=auth("admin")) as s:
        yield s


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def rss_mib(pid: int) -> float:
    """The server process's resident memory (VmRSS), MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def cpu_seconds(pid: int) -> float:
    """The server process's user + system CPU time, all threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime, stime in clock ticks (USER_HZ is 100 on Linux)


@pytest.mark.serial  # timing: /health latency while the prompts arrive
def test_4mib_prompts_in_a_row_are_refused_without_stalling_or_keeping_memory(server):
    completions = server.url + "/v1/completions"
    warm = httpx.post(completions, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, headers=auth("admin"),
                      timeout=120)
    assert warm.status_code == 200
    baseline = rss_mib(server.proc.pid)
    latencies: list[float] = []
    done = threading.Event()

    def poll_health() -> None:  # another client, one idle keep-alive connection
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not done.is_set():
                start = time.monotonic()
                assert c.get("/health").status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.005)  # often enough for 10 polls while 20 refusals run (0.2 s in all on Zen 5)

    poller = threading.Thread(target=poll_health)
    poller.start()
    statuses, messages, began = [], [], time.monotonic()
    try:
        with httpx.Client(timeout=120, headers=auth("big")) as c:
            for _ in range(20):
                r = c.post(completions, json={"model": MODEL, "prompt": HUGE, "max_tokens": 2})
                statuses.append(r.status_code)
                messages.append(r.json()["error"]["message"])
    finally:
        done.set()
        poller.join()
    elapsed = time.monotonic() - began
    # Five a minute: the first five are refused for their length and counted, then 429 (one more 400 for each
    # request the bucket refilled while they ran: one per 12 s).
    refills = int(elapsed / 12)
    assert statuses[:5] == [400] * 5 and set(statuses) == {400, 429}, statuses
    assert statuses.count(400) <= 5 + refills, statuses
    assert all("at least" in m and "context is 8192 tokens" in m for m, s in zip(messages, statuses) if s == 400)
    assert all("5 requests per minute" in m for m, s in zip(messages, statuses) if s == 429)
    assert server.metric("lmserve:key_rejections_total", 'key_name="big",reason="requests_per_minute"') \
        == statuses.count(429)
    assert len(latencies) >= 10 and max(latencies) <= 0.2, sorted(latencies)[-5:]
    time.sleep(3)  # the heap is trimmed once large requests have stopped for a second (server/app.py HeapTrim)
    after = rss_mib(server.proc.pid)
    assert after <= 1.10 * baseline, (baseline, after)


def test_every_route_that_does_work_takes_a_request_from_the_key(server):
    url = server.url
    # /tokenize and /detokenize (OpenAI-shaped errors)
    for name, path, body in (("tok", "/tokenize", {"model": MODEL, "prompt": "Hello"}),
                             ("detok", "/detokenize", {"model": MODEL, "tokens": [19556]})):
        assert httpx.post(url + path, json=body, headers=auth(name), timeout=60).status_code == 200
        r = httpx.post(url + path, json=body, headers=auth(name), timeout=60)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
        assert int(r.headers["Retry-After"]) >= 1 and r.headers["x-ratelimit-remaining-requests"] == "0"
    # Anthropic's count_tokens, through Anthropic's client (its error shape)
    claude = anthropic.Anthropic(base_url=url, api_key=KEYS["count"], max_retries=0)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}])
    assert claude.messages.count_tokens(**ask).input_tokens > 0
    with pytest.raises(anthropic.RateLimitError) as e:
        claude.messages.count_tokens(**ask)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "rate_limit_error"
    # a file upload, through OpenAI's client
    files = openai.OpenAI(base_url=url + "/v1", api_key=KEYS["files"], max_retries=0).files
    assert files.create(file=("a.jsonl", b"{}\n"), purpose="batch").id
    with pytest.raises(openai.RateLimitError, match="1 requests per minute"):
        files.create(file=("b.jsonl", b"{}\n"), purpose="batch")
    # a playground share: a refused share counts too (the request did its work: parsing)
    share = {"mode": "completion", "model": MODEL, "prompt": "Hi", "params": {}, "output": {"text": "!"}}
    assert httpx.post(url + "/playground/api/shares", json={**share, "mode": "x"}, headers=auth("share"),
                      timeout=60).status_code == 400
    r = httpx.post(url + "/playground/api/shares", json=share, headers=auth("share"), timeout=60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
    for name in ("tok", "detok", "count", "files", "share"):
        assert server.metric("lmserve:key_rejections_total", f'key_name="{name}",reason="requests_per_minute"') == 1
    # reading is free: the spent keys still list models
    assert httpx.get(url + "/v1/models", headers=auth("tok"), timeout=60).status_code == 200


def test_a_prompt_past_the_token_quota_by_its_bytes_is_refused_before_tokenizing(server):
    """400 KB of text is at least 400,000 / 81 = 4,939 tokens (SmolLM2's longest token stands for 81 bytes):
    more than the key's 2,000 a minute, within the context. Refused without the ~0.5 CPU-seconds its tokenizing
    takes, which /tokenize of the same text (another key) shows. Random numbers: SmolLM2 splits digits one by one, so
    tokenizing them costs ~0.7 CPU s on a Zen 4 against the refusal's ~0.06 (words tokenize 3-4x faster there, and a
    repeated phrase is answered from the tokenizer's word cache: 0.14-0.22 CPU s, too close to compare)."""
    rng = random.Random(0)
    text = " ".join(str(rng.randint(0, 10**9)) for _ in range(41_000))[:399_996]  # as 33,333 times "hello world "
    pid = server.proc.pid
    before = cpu_seconds(pid)
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 2},
                   headers=auth("tpm"), timeout=120)
    refused_cpu = cpu_seconds(pid) - before
    assert r.status_code == 429 and "2000 tokens per minute" in r.json()["error"]["message"], r.text
    assert "needs at least 4941" in r.json()["error"]["message"]  # 4,939 by its bytes + max_tokens
    assert "Retry-After" not in r.headers  # more than the whole minute's tokens: it never fits
    before = cpu_seconds(pid)
    counted = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text}, headers=auth("admin"),
                         timeout=120)
    tokenize_cpu = cpu_seconds(pid) - before
    assert counted.status_code == 200 and counted.json()["count"] > 60_000
    assert refused_cpu < 0.25 * tokenize_cpu, (refused_cpu, tokenize_cpu)
    # the same key's ordinary request still runs: nothing was taken from its tokens
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                    headers=auth("tpm"), timeout=120)
    assert ok.status_code == 200 and int(ok.headers["x-ratelimit-remaining-tokens"]) >= 2000 - 10



def test_a_requests_first_short_prompts_are_tokenized_on_the_event_loop_and_the_rest_in_a_thread():
    """served.py INLINE_WORK: a request's prompts are tokenized (ids checked) where the route runs while their work
    stays within the request's budget, in a worker thread past it, and a long one always in a thread; the ids are
    the real tokenizer's either way."""
    import asyncio
    from types import SimpleNamespace

    from lmserve.ops.record import RequestRecord
    from lmserve.server.served import INLINE_WORK, ModelState
    from lmserve.tokenizer.tokenizer import Tokenizer
    from tests.encoder_models import minilm_dir

    tok = Tokenizer.from_pretrained(minilm_dir())
    threads: list[int] = []

    def tokenize_prompt(prompt):
        threads.append(threading.get_ident())
        return tok.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)

    state = SimpleNamespace(front=SimpleNamespace(tokenize_prompt=tokenize_prompt))
    sentence = "Retrieval augmented generation needs a fast embedder next to the chat model."  # 77 characters
    many = [sentence] * (INLINE_WORK // len(sentence) + 2)  # one request: the budget runs out after three

    async def run():
        loop_thread, first = threading.get_ident(), RequestRecord("a", "/v1/embeddings")
        got = [await ModelState.tokenize(state, p, first) for p in many]
        got.append(await ModelState.tokenize(state, sentence * 4, RequestRecord("b", "/v1/embeddings")))  # too long
        got.append(await ModelState.tokenize(state, list(range(2 * INLINE_WORK)), RequestRecord("c", "/tokenize")))
        got.append(await ModelState.tokenize(state, list(range(2 * INLINE_WORK + 2)), RequestRecord("d", "/tokenize")))
        return loop_thread, first, got

    loop_thread, first, got = asyncio.run(run())
    on_loop = INLINE_WORK // len(sentence)
    assert [t == loop_thread for t in threads] == [True] * on_loop + [False] * (len(many) - on_loop) + [False, True,
                                                                                                        False]
    assert got[:len(many)] == [tok.encode_prompt(sentence)] * len(many) and got[len(many)] == tok.encode_prompt(
        sentence * 4)
    assert first.inline_work == on_loop * len(sentence) and first.tokenize_s > 0
    assert not tok.bounds_built and tok.bounds is not None and tok.bounds_built  # built on first use, then free
