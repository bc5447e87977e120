"""Response-cache latency: p50 of a miss (the model answers) and of a hit, for SQLite and a local Redis.

    python benchmarks/response_cache.py [--requests 20] [--max-tokens 32] [--output benchmarks/results/response_cache.md]

Starts `lmserve serve` on the embedded model once per backend (Redis: a redis-server it starts on a free port)
and sends each of N distinct greedy prompts twice: the first is a miss, the second a hit. Both backends run in
one invocation, on one machine, so the numbers compare.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server_util import MODEL, free_port, running_server  # noqa: E402


def measure(url: str, n: int, max_tokens: int) -> tuple[list[float], list[float]]:
    misses, hits = [], []
    client = httpx.Client(timeout=120)  # one kept-alive connection: a new client per request costs ~25 ms itself
    for i in range(n):
        body = {"model": MODEL, "prompt": f"Write a sentence about the number {i}.", "max_tokens": max_tokens,
                "temperature": 0}
        for bucket, expected in ((misses, "miss"), (hits, "hit")):
            start = time.perf_counter()
            r = client.post(url + "/v1/completions", json=body)
            bucket.append(time.perf_counter() - start)
            assert r.status_code == 200 and r.headers["x-lmserve-cache"] == expected, r.headers
    return misses, hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--output", default=None, help="also write the table (markdown) here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        backends = [("sqlite", f"sqlite:{tmp}/cache.sqlite", None)]
        if shutil.which("redis-server"):
            port = free_port()
            redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL)
            time.sleep(0.5)
            backends.append(("redis", f"redis://127.0.0.1:{port}/0", redis))
        for name, url, proc in backends:
            with running_server("--response-cache", url) as s:
                misses, hits = measure(s.url, args.requests, args.max_tokens)
            if proc is not None:
                proc.kill()
            rows.append((name, statistics.median(misses) * 1e3, statistics.median(hits) * 1e3))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    lines = [f"Machine: {cpu}, {platform.machine()}; {args.requests} prompts x 2, max_tokens {args.max_tokens}, greedy.",
             "", "| backend | miss p50 (ms) | hit p50 (ms) | speed-up |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {n} | {m:.1f} | {h:.1f} | {m / h:.0f}x |" for n, m, h in rows]
    text = "\n".join(lines)
    print(text)
    if args.output:
        Path(args.output).write_text(f"# Response cache latency\n\n`python benchmarks/response_cache.py`\n\n{text}\n")


if __name__ == "__main__":
    main()
