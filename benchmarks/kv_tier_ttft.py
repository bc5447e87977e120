"""TTFT of a repeated ~2,000-token system prompt with the KV tier (issue 32): disk tier after a restart, host
tier after the pool evicted it, against a cold start.

    python benchmarks/kv_tier_ttft.py [--system-words 1500] [--rounds 3] [--output-dir benchmarks/results]

Every round starts fresh servers on the embedded model (a pool of --num-kv-blocks 136: the system prompt and
its answer fit, one other long prompt evicts it), each warmed with a short unrelated request before anything
is timed, and measures one streamed chat request (the system prompt, then a question new to the round):
- cold: a server without the tier; the system prompt is computed;
- disk: a server given --kv-offload-dir, which a previous server (stopped with SIGTERM) filled by answering the
  same system prompt once: the first request after the restart loads it from disk;
- host: one server with --kv-offload-memory 2GiB: the system prompt is answered, a long unrelated prompt
  evicts it from the pool (its blocks go to host memory), then the timed request loads it back;
- pool: the same server asked again at once (a plain prefix-cache hit), for reference.
TTFT is from sending the request to the first streamed content, at the client; the hit tokens of each
request come from /metrics. The target: disk / cold <= 0.25x. Scenarios alternate within each round and the
medians are reported with the load average before and after: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.server_util import MODEL, running_server  # noqa: E402

POOL = ["--num-kv-blocks", "136"]  # 2,176 tokens: the system prompt and its answer, no room for a second prompt
QUESTIONS = ["Which warehouse ships orders to Lyon?", "What is the return window for opened items?",
             "How do I reset the controller?", "Summarise the safety section in one line.",
             "Who approves a refund above the limit?", "When does the night shift start?"]


def system_prompt(words: int) -> str:
    """The first `words` words of the shipped fidelity text (natural prose, ~1.3 tokens a word)."""
    text = (ROOT / "benchmarks/data/fidelity_text.txt").read_text(encoding="utf-8").split()
    return "You answer questions about the text below.\n\n" + " ".join(text[:words])


class Client:
    """One server: a streamed chat request timed to its first content, and the tier counters it moved."""

    def __init__(self, url: str) -> None:
        self.url, self.http = url, httpx.Client(timeout=1200)

    def counters(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in self.http.get(self.url + "/metrics").text.splitlines():
            for name in ("lmserve:prefix_cache_hit_tokens_total", "lmserve:kv_offload_hit_tokens_total"):
                if line.startswith(name):
                    label = line[len(name):].split(" ")[0]
                    tier = label.split('tier="')[1].split('"')[0] if 'tier="' in label else "pool"
                    out[tier] = out.get(tier, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def ask(self, system: str, question: str, max_tokens: int = 8) -> dict:
        """TTFT in seconds, prompt tokens and the hit tokens (all caches; per tier) of one request."""
        body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        before = self.counters()
        start = time.perf_counter()
        ttft, usage = None, None
        with self.http.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.perf_counter() - start
                usage = chunk.get("usage") or usage
        after = self.counters()
        hits = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        return {"ttft_s": ttft, "prompt_tokens": usage["prompt_tokens"], "hit_tokens": hits.pop("pool", 0.0),
                "tier_hit_tokens": hits}


def warm(c: Client) -> None:
    """One short request first: a server's first step pays one-time costs the scenarios must not."""
    c.ask("You are brief.", "Say hello.", max_tokens=2)


def one_round(system: str, fillers: list[str], question: str, rnd: int) -> dict:
    res = {}
    with running_server(*POOL) as s:
        c = Client(s.url)
        warm(c)
        res["cold"] = c.ask(system, question)
    with tempfile.TemporaryDirectory(prefix="lmserve-kv-tier-") as kv:
        with running_server(*POOL, "--kv-offload-dir", kv) as s:
            c = Client(s.url)
            c.ask(system, QUESTIONS[-1 - rnd % len(QUESTIONS)])  # fills the disk tier (written through)
        files = sum(1 for _ in Path(kv).rglob("*.kvb"))
        with running_server(*POOL, "--kv-offload-dir", kv) as s:
            c = Client(s.url)
            warm(c)
            res["disk"] = c.ask(system, question) | {"files_after_first_server": files}
    with running_server(*POOL, "--kv-offload-memory", "2GiB") as s:
        c = Client(s.url)
        warm(c)
        c.ask(system, QUESTIONS[-1 - rnd % len(QUESTIONS)])
        for filler in fillers:  # other long prompts evict the system prompt's blocks into host memory
            c.ask(filler, "Anything?", max_tokens=2)
        res["host"] = c.ask(system, question)
        res["pool"] = c.ask(system, question + " Again, please.")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system-words", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks/results")
    args = ap.parse_args()
    system = system_prompt(args.system_words)
    text = (ROOT / "benchmarks/data/fidelity_text.txt").read_text(encoding="utf-8").split()
    # three ~1,000-token prompts: together more blocks than the pool has, so none of the system prompt's remain
    fillers = [f"Another document ({i}).\n\n" + " ".join(text[len(text) - 650 * (3 - i):len(text) - 650 * (2 - i)])
               for i in range(3)]
    load_before = os.getloadavg()
    rounds = []
    for rnd in range(args.rounds):
        rounds.append(one_round(system, fillers, QUESTIONS[rnd % len(QUESTIONS)], rnd))
        print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    med = {k: statistics.median(r[k]["ttft_s"] for r in rounds) for k in ("cold", "disk", "host", "pool")}
    result = {
        "system_words": args.system_words, "rounds": rounds, "median_ttft_s": med,
        "ratio_vs_cold": {k: med[k] / med["cold"] for k in ("disk", "host", "pool")},
        "prompt_tokens": rounds[0]["cold"]["prompt_tokens"],
        "load_average_before": load_before, "load_average_after": load_after, "cpus": os.cpu_count(),
        "cpu": platform.processor() or _cpu_model(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "kv_tier_ttft.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.output_dir / "kv_tier_ttft.md").write_text(report(result))
    print(report(result))
    return 0


def report(r: dict) -> str:
    med, ratio = r["median_ttft_s"], r["ratio_vs_cold"]
    tier = {k: statistics.median(x[k]["tier_hit_tokens"].get(k, 0.0) for x in r["rounds"]) for k in ("disk", "host")}
    rows = [("cold (no tier, fresh server)", med["cold"], 1.0, "0"),
            ("disk tier, first request after a restart", med["disk"], ratio["disk"], f"{tier['disk']:.0f} from disk"),
            ("host tier, after the pool evicted it", med["host"], ratio["host"], f"{tier['host']:.0f} from host"),
            ("pool (plain prefix hit), for reference", med["pool"], ratio["pool"], "pool")]
    lines = [f"# KV tier: TTFT of a repeated {r['prompt_tokens']}-token system prompt (`{r['command']}`)", "",
             f"Embedded SmolLM2-135M Q4_1 GGUF, default flags plus `{' '.join(POOL)}`, {r['cpus']} CPUs ({r['cpu']}); "
             f"median of {len(r['rounds'])} rounds, scenarios alternating within each round. Load average "
             f"{r['load_average_before'][0]:.1f} before, {r['load_average_after'][0]:.1f} after (a shared machine).", "",
             "| scenario | TTFT p50 | vs cold | prompt tokens loaded |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {s:.2f} s | {x:.3f}x | {hits} |" for name, s, x, hits in rows]
    lines += ["", f"Target (issue 32): disk tier vs cold <= 0.25x; measured {ratio['disk']:.3f}x.", ""]
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
