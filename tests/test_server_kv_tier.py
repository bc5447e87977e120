"""The KV tier on the real server: a long prompt is answered from --kv-offload-dir after a restart, with the same
tokens and logprobs, for its own API key only; hits asserted from /metrics, never from timings."""

from __future__ import annotations

import subprocess
import sys
import time

import openai

from tests.server_util import running_server

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
    bad_dir = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--kv-offload-dir", "/proc/lmserve-kv"],
                             capture_output=True, text=True, timeout=120)
    assert bad_dir.returncode == 2 and "--kv-offload-dir /proc/lmserve-kv: cannot write there" in bad_dir.stderr
    bad_size = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--kv-offload-memory", "2XB"],
                              capture_output=True, text=True, timeout=120)
    assert bad_size.returncode == 2 and "'2XB' is not a size" in bad_size.stderr
