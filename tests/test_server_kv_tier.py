"""The KV tier on the real server: a long prompt is answered from --kv-offload-dir after a restart, with the same
tokens and logprobs, for its own API key only; hits asserted from /metrics, never from timings."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import openai

from lmserve.cache.kv_disk import HEADER, SIGNED
from tests.server_util import free_port, running_server

KEYS = ("sk-tier-a-0123456789abcdef", "sk-tier-b-0123456789abcdef")
WORDS = ("A long system prompt sets out the house rules: answer briefly, cite the manual, never guess a part "
         "number, and say which warehouse ships each order before quoting a delivery date. ").split()
PROMPT = " ".join(WORDS[i % len(WORDS)] for i in range(260))


def complete(server, key: str) -> tuple[openai.types.Completion, list]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    return r, [r.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs]


def disk(server, name: str) -> float:
    return server.metric(f"lmserve:kv_offload_{name}", 'tier="disk"')


def test_a_long_prompt_is_answered_from_disk_after_a_restart_for_its_key_alone(tmp_path):
    args = ("--kv-offload-dir", str(tmp_path / "kv"), "--api-key", KEYS[0], "--api-key", KEYS[1],
            "--metrics-public")  # plain keys read /metrics only so
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    with running_server(*args, headers=headers) as first:
        r, cold = complete(first, KEYS[0])
        n = r.usage.prompt_tokens
        assert n > 200
        deadline = time.time() + 120  # the writer thread's queue drains; a bound, not a measurement
        while disk(first, "stores_total") < n // 16 and time.time() < deadline:
            time.sleep(0.2)
        assert disk(first, "stores_total") >= n // 16 and disk(first, "usage_bytes") > 0
        assert disk(first, "hit_tokens_total") == 0
    files = list((tmp_path / "kv").rglob("*.kvb"))
    assert len(files) >= n // 16

    with running_server(*args, headers=headers) as second:
        complete(second, KEYS[1])  # another key's request for the same prompt: none of the first key's blocks
        assert disk(second, "hit_tokens_total") == 0 and second.metric("lmserve:prefix_cache_hit_tokens_total") == 0
        _, again = complete(second, KEYS[0])
        hit = (n - 1) // 16 * 16
        assert disk(second, "hit_tokens_total") == hit and disk(second, "loads_total") == hit // 16
        assert second.metric("lmserve:prefix_cache_hit_tokens_total") == hit
        assert disk(second, "load_bytes_total") > 0 and second.metric("lmserve:kv_offload_disk_rejected_files_total") == 0
        assert again == cold  # text, tokens, logprobs and top logprobs: the loaded KV is the computed KV
        second.wait_idle()


def test_bad_tier_flags_are_one_line_errors():
    bad_dir = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(free_port()), "--kv-offload-dir", "/proc/lmserve-kv"],
                             capture_output=True, text=True, timeout=120)
    assert bad_dir.returncode == 2 and "--kv-offload-dir /proc/lmserve-kv: cannot write there" in bad_dir.stderr
    bad_size = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(free_port()), "--kv-offload-memory", "2XB"],
                              capture_output=True, text=True, timeout=120)
    assert bad_size.returncode == 2 and "'2XB' is not a size" in bad_size.stderr


KEY_FILE = ("keys:\n  - {name: team-a, key: sk-team-a-0123456789abcdef}\n"
            "  - {name: team-b, key: sk-team-b-0123456789abcdef}\n"
            "  - {name: ops, key: sk-ops-0123456789abcdef, role: admin}\n")
ADMIN = {"Authorization": "Bearer sk-ops-0123456789abcdef"}  # reads /metrics


def test_blocks_planted_under_another_keys_names_are_refused_after_a_restart(tmp_path):
    """Issue 47, finding 6, as team-b would try it with write access to the tier's directory. First, files forged
    from team-a's own headers (the block hash is in the clear) with other bytes and a MAC made without the secret;
    then team-b's genuine, signed blocks of the same prompt copied over team-a's files. After each restart team-a's
    greedy answer is the same, and the planted files are refused and counted, never loaded."""
    (tmp_path / "keys.yaml").write_text(KEY_FILE)
    kv = tmp_path / "kv"
    args = ("--kv-offload-dir", str(kv), "--api-key-file", str(tmp_path / "keys.yaml"))
    a, b = "sk-team-a-0123456789abcdef", "sk-team-b-0123456789abcdef"
    with running_server(*args, headers=ADMIN) as first:
        r, cold = complete(first, a)
        n = r.usage.prompt_tokens
        _wait_stores(first, n // 16)
        team_a = sorted(kv.rglob("*.kvb"))
        complete(first, b)
        _wait_stores(first, 2 * (n // 16))
    team_b = sorted(set(kv.rglob("*.kvb")) - set(team_a))
    assert len(team_a) >= n // 16 and len(team_b) == len(team_a)

    for mine, theirs in zip(team_a, team_b):  # team-a's header, team-b's bytes, a MAC guessed without the secret
        signed = mine.read_bytes()[:SIGNED.size]
        payload = theirs.read_bytes()[HEADER.size:]
        mine.write_bytes(signed + hashlib.sha256(signed + payload).digest() + payload)
    _assert_refused(args, a, cold)

    for mine, theirs in zip(team_a, team_b):  # team-b's genuine blocks under team-a's names
        if mine.exists():
            mine.write_bytes(theirs.read_bytes())
    _assert_refused(args, a, cold)


def _assert_refused(args: tuple[str, ...], key: str, cold: list) -> None:
    """A restart: `key`'s prompt gets the answer it got cold, and at least its first planted file is refused."""
    with running_server(*args, headers=ADMIN) as server:
        _, again = complete(server, key)
        assert again == cold  # the same greedy tokens and logprobs: nothing planted reached the model
        assert server.metric("lmserve:kv_offload_disk_rejected_files_total") >= 1
        assert disk(server, "hit_tokens_total") == 0  # its first block was refused: nothing after it was loaded
        server.wait_idle()


def _wait_stores(server, n: int) -> None:
    deadline = time.time() + 120  # the writer thread's queue drains; a bound, not a measurement
    while disk(server, "stores_total") < n and time.time() < deadline:
        time.sleep(0.2)
    assert disk(server, "stores_total") >= n


def test_a_kv_offload_dir_every_user_may_write_is_refused_at_start(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp
    p = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(free_port()), "--kv-offload-dir", str(shared)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")})
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"--kv-offload-dir {shared}: refused: " in p.stderr and "writable by every user" in p.stderr
    assert not list(shared.iterdir())
