"""Prefix-cache timing across API keys (issue 35): can key B time key A's prompts, and what does opting in to
sharing give back?

    python benchmarks/tenant_prefix_timing.py [--words 1400] [--rounds 3] [--questions 4] [--system-words 1000]
                                              [--output-dir benchmarks/results]

1. Cross-key probe (a server with isolated keys, the default): key A sends a prompt of --words words; key B
   resends it (`"cache": false`) and sends an unseen prompt of the same length, in alternating order; A resends
   its own as the control. B's time over the unseen prompt's should be ~1x (the target is >= 0.5x), with 0 hit
   tokens; A's resend shows the cache still works within a key.
2. A shared system prompt of --system-words words, then --questions short questions sent alternately by two
   clients, four ways: a server without keys (today's shared cache), two `prefix_cache: shared` keys, two
   isolated keys sending the same `cache_salt`, and two isolated keys without one (what isolation costs: each
   key prefills the system prompt once). Hit rate = prefix-cache hit tokens / prompt tokens of the questions.

Times are of a completion with max_tokens 1 (time to first token plus one decode step), from the client.
Servers run the embedded model with 1 GiB of KV cache, so nothing is evicted mid-measurement. Writes
tenant_prefix_timing.json and .md, with the load average: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server_util import MODEL, running_server  # noqa: E402

KEYS = {name: f"sk-bench-{name}-0123456789" for name in ("team-a", "team-b", "shared-1", "shared-2", "ops")}
KV = ["--kv-cache-memory", str(2**30)]
WORDS = ("report market river garden engine signal winter harbor copper violet method ledger orbit canvas pilot "
         "meadow quartz lantern fabric summit timber falcon beacon mosaic tundra anchor velvet prism cobalt "
         "harvest glacier saddle crystal thunder compass marble willow ember").split()


def text(words: int, seed: int) -> str:
    """`words` words drawn from a fixed list: distinct prompts of one length for distinct seeds."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


class Client:
    """One server's view: timed max_tokens-1 completions and the counters they move."""

    def __init__(self, url: str, admin: str | None) -> None:
        self.url, self.http = url, httpx.Client(timeout=600)
        self.metrics_headers = {"Authorization": f"Bearer {admin}"} if admin else {}

    def counter(self, name: str) -> float:
        body = self.http.get(self.url + "/metrics", headers=self.metrics_headers).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def send(self, key: str | None, prompt: str, salt: str | None = None) -> dict:
        """Seconds, prompt tokens and prefix-cache hit tokens of one request (requests here run one at a time)."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "cache": False,
                **({"cache_salt": salt} if salt else {})}
        headers = {"Authorization": f"Bearer {KEYS[key]}"} if key else {}
        hits = self.counter("lmserve:prefix_cache_hit_tokens_total")
        start = time.perf_counter()
        r = self.http.post(self.url + "/v1/completions", json=body, headers=headers)
        seconds = time.perf_counter() - start
        r.raise_for_status()
        return {"s": seconds, "prompt_tokens": r.json()["usage"]["prompt_tokens"],
                "hit_tokens": self.counter("lmserve:prefix_cache_hit_tokens_total") - hits}


def key_file(directory: Path) -> Path:
    path = directory / "keys.yaml"
    extra = {"shared-1": ", prefix_cache: shared", "shared-2": ", prefix_cache: shared", "ops": ", role: admin"}
    path.write_text("keys:\n" + "".join(f"  - {{name: {n}, key: {k}{extra.get(n, '')}}}\n" for n, k in KEYS.items()))
    return path


def cross_key(c: Client, words: int, rounds: int) -> dict:
    """A's prompt resent by B vs an unseen prompt of the same length (B), and A's own resend."""
    rows = []
    for r in range(rounds):
        seen, unseen = text(words, 1000 + r), text(words, 2000 + r)
        cold_a = c.send("team-a", seen)
        probes = [("b_resend", seen), ("b_unseen", unseen)]
        row = {"a_first": cold_a}
        for name, prompt in (probes if r % 2 == 0 else probes[::-1]):  # alternate the order: drift cancels
            row[name] = c.send("team-b", prompt)
        row["a_resend"] = c.send("team-a", seen)
        rows.append(row)
        print(f"  round {r}: " + ", ".join(f"{k} {v['s']:.2f} s ({v['hit_tokens']:.0f} hit)" for k, v in row.items()),
              flush=True)
    p50 = {k: statistics.median(row[k]["s"] for row in rows) for k in rows[0]}
    return {"rounds": rows, "p50_s": p50, "b_over_unseen": p50["b_resend"] / p50["b_unseen"],
            "b_hit_tokens": sum(row["b_resend"]["hit_tokens"] for row in rows),
            "prompt_tokens": rows[0]["a_first"]["prompt_tokens"]}


def system_prompt(c: Client, system: str, questions: int, clients: tuple, salt: str | None = None) -> dict:
    """One client warms the system prompt; then `questions` questions alternate between the two clients."""
    c.send(clients[0], f"{system}\n\nQuestion 0: what is this about?", salt)
    rows = [c.send(clients[(i + 1) % 2], f"{system}\n\nQuestion {i}: what does word {i} mean?", salt)
            for i in range(1, questions + 1)]
    return {"rows": rows, "ttft_p50_s": statistics.median(r["s"] for r in rows),
            "hit_rate": sum(r["hit_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)}


def run(args: argparse.Namespace) -> dict:
    system = text(args.system_words, 7)
    out: dict = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        keys = key_file(Path(tmp))
        with running_server("--api-key-file", str(keys), *KV) as s:
            c = Client(s.url, KEYS["ops"])
            c.send("team-a", "warm up")
            print("cross-key probe (isolated keys):", flush=True)
            out["cross_key"] = cross_key(c, args.words, args.rounds)
            print("shared system prompt:", flush=True)
            out["shared_keys"] = system_prompt(c, f"(k) {system}", args.questions, ("shared-1", "shared-2"))
            out["same_cache_salt"] = system_prompt(c, f"(s) {system}", args.questions, ("team-a", "team-b"), "sys-v1")
            out["isolated_keys"] = system_prompt(c, f"(i) {system}", args.questions, ("team-a", "team-b"))
        with running_server(*KV) as s:
            c = Client(s.url, None)
            c.send(None, "warm up")
            out["no_keys"] = system_prompt(c, f"(n) {system}", args.questions, (None, None))
    out["load_after"] = os.getloadavg()
    return out


def report(args: argparse.Namespace, out: dict) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    x, p = out["cross_key"], out["cross_key"]["p50_s"]
    load = lambda t: ", ".join(f"{v:.1f}" for v in t)  # noqa: E731
    lines = [
        "# Prefix-cache timing across API keys", "",
        f"`python benchmarks/tenant_prefix_timing.py --words {args.words} --rounds {args.rounds} --questions "
        f"{args.questions} --system-words {args.system_words}`", "",
        f"Machine: {cpu}, {os.cpu_count()} CPUs, shared with other work: load average {load(out['load_before'])} "
        f"before, {load(out['load_after'])} after. Embedded SmolLM2-135M Q4_1; times are max_tokens-1 completions "
        "(time to first token plus one step), p50.", "",
        f"## B resends A's {args.words}-word prompt ({x['prompt_tokens']} tokens), isolated keys", "",
        "| request | p50 (s) | hit tokens (all rounds) |", "| --- | ---: | ---: |",
        f"| A's first send | {p['a_first']:.2f} | {sum(r['a_first']['hit_tokens'] for r in x['rounds']):.0f} |",
        f"| B resends A's prompt | {p['b_resend']:.2f} | {x['b_hit_tokens']:.0f} |",
        f"| B sends an unseen prompt of the same length | {p['b_unseen']:.2f} | "
        f"{sum(r['b_unseen']['hit_tokens'] for r in x['rounds']):.0f} |",
        f"| A resends its own prompt (control) | {p['a_resend']:.2f} | "
        f"{sum(r['a_resend']['hit_tokens'] for r in x['rounds']):.0f} |", "",
        f"B's time over the unseen prompt's: **{x['b_over_unseen']:.2f}x** (target >= 0.5x: no hit).", "",
        f"## A shared {args.system_words}-word system prompt, {args.questions} questions from two clients", "",
        "| setup | hit rate | TTFT p50 (s) |", "| --- | ---: | ---: |"]
    for name, label in (("no_keys", "no keys (today's shared cache)"),
                        ("shared_keys", "two `prefix_cache: shared` keys"),
                        ("same_cache_salt", "two isolated keys, same `cache_salt`"),
                        ("isolated_keys", "two isolated keys (the default)")):
        lines.append(f"| {label} | {out[name]['hit_rate']:.1%} | {out[name]['ttft_p50_s']:.2f} |")
    lines += ["", "Isolated keys lose one cold prefill of the system prompt per key (the first question of the "
              "second key); opting in (shared keys or a common cache_salt) gives back today's hit rate. The hot "
              f"TTFTs are {args.questions} requests per setup on a shared machine: compare hit rates, and TTFTs only "
              "as hot (a hit) against cold (a prefill)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--words", type=int, default=1400, help="words of A's prompt (and of the unseen one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--questions", type=int, default=4, help="questions after the system prompt, per setup")
    ap.add_argument("--system-words", type=int, default=1000)
    ap.add_argument("--output-dir", default=None, help="write tenant_prefix_timing.json and .md here")
    args = ap.parse_args()
    out = run(args)
    text_md = report(args, out)
    print(text_md)
    if args.output_dir:
        d = Path(args.output_dir)
        (d / "tenant_prefix_timing.json").write_text(json.dumps({"args": vars(args), **out}, indent=1) + "\n")
        (d / "tenant_prefix_timing.md").write_text(text_md)


if __name__ == "__main__":
    main()
