"""`lmserve bench serve`: a load generator for any OpenAI-compatible server (one asyncio process).

Streams every request and reports what vLLM's serving benchmark reports: completed/failed, request
and token throughput, TTFT, TPOT (first token excluded), ITL (every gap between streamed chunks),
end-to-end latency (mean, median, p90, p99), goodput under SLOs, and the client's own CPU time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np


@dataclass
class BenchRequest:
    """One prompt to send: token ids (completions endpoint) or text, and the output length to ask for."""

    prompt: list[int] | str
    output_len: int


@dataclass
class RequestResult:
    """What one streamed request measured (seconds)."""

    ok: bool
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    text: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int) -> list[BenchRequest]:
    """Random token-id prompts with lengths uniform in [L(1-r), L(1+r)] (exact input lengths, any tokenizer)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lin = max(1, int(input_len * (1 + rng.uniform(-range_ratio, range_ratio))))
        lout = max(1, int(output_len * (1 + rng.uniform(-range_ratio, range_ratio))))
        out.append(BenchRequest([rng.randrange(100, vocab) for _ in range(lin)], lout))
    return out


def jsonl_dataset(path: Path, n: int, output_len: int) -> list[BenchRequest]:
    """Lines of {"prompt": str, "output_len"?: int}; cycled to n requests."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [BenchRequest(r["prompt"], int(r.get("output_len", output_len))) for r in (rows * (n // len(rows) + 1))[:n]]


def _body(req: BenchRequest, model: str, endpoint: str, ignore_eos: bool) -> dict:
    common = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
              "stream_options": {"include_usage": True}}
    if ignore_eos:
        common["ignore_eos"] = True
    if endpoint == "chat":
        text = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        return {**common, "messages": [{"role": "user", "content": text}]}
    return {**common, "prompt": req.prompt}


async def send_one(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> RequestResult:
    """Stream one request; time each content chunk."""
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                msg = json.loads(line[5:])
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                    res.output_tokens = msg["usage"].get("completion_tokens", 0)
                text = _chunk_text(msg)
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last, chunks = now, chunks + 1
                res.text += text
        res.e2el = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


def _chunk_text(msg: dict) -> str:
    choices = msg.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return (c.get("delta") or {}).get("content") or c.get("text") or ""


async def run_load(base_url: str, model: str, endpoint: str, requests: list[BenchRequest], concurrency: int | None,
                   request_rate: float | None, api_key: str | None, ignore_eos: bool, seed: int,
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send all requests (bounded concurrency and/or Poisson arrivals); returns results and wall time."""
    from tqdm import tqdm

    url = base_url.rstrip("/") + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency or len(requests))
    rng = np.random.default_rng(seed)
    bar = tqdm(total=len(requests), desc=f"c={concurrency or '-'} r={request_rate or 'inf'}", disable=not progress)
    limits = httpx.Limits(max_connections=(concurrency or len(requests)) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def one(req: BenchRequest) -> RequestResult:
            async with sem:
                r = await send_one(client, url, _body(req, model, endpoint, ignore_eos), headers)
            bar.update(1)
            return r

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if request_rate:
                await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    bar.close()
    return list(results), wall


def _stats(xs: list[float], scale: float = 1000.0) -> dict:
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(xs) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 0.5, 'tpot': 0.05} (milliseconds in, seconds out)."""
    out = {}
    for spec in specs:
        key, _, ms = spec.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"bad goodput SLO {spec!r}: use ttft:MS, tpot:MS or e2el:MS")
        out[key] = float(ms) / 1000.0
    return out


def summarize(results: list[RequestResult], wall: float, slos: dict[str, float], cpu_seconds: float) -> dict:
    """The vLLM-style report of one run (latencies in ms)."""
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    good = [r for r in ok if all(getattr(r, k) <= v for k, v in slos.items())]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": wall,
        "request_throughput": len(ok) / wall, "output_throughput": out_tok / wall,
        "total_token_throughput": (in_tok + out_tok) / wall,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": _stats([g for r in ok for g in r.itl]), "e2el_ms": _stats([r.e2el for r in ok]),
        "goodput": len(good) / wall if slos else None, "slos_s": slos,
        "client_cpu_s": cpu_seconds, "errors": sorted({r.error for r in results if r.error})[:5],
    }


def format_summary(s: dict) -> str:
    lines = [f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.1f} s  "
             f"client CPU {s['client_cpu_s']:.1f} s",
             f"request throughput {s['request_throughput']:.2f} req/s  output {s['output_throughput']:.1f} tok/s  "
             f"total {s['total_token_throughput']:.1f} tok/s" +
             (f"  goodput {s['goodput']:.2f} req/s" if s["goodput"] is not None else "")]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        m = s[key]
        lines.append(f"{key[:-3].upper():5} ms  mean {m['mean']:8.1f}  median {m['median']:8.1f}  "
                     f"p90 {m['p90']:8.1f}  p99 {m['p99']:8.1f}")
    return "\n".join(lines)


def plot_sweep(rows: list[dict], path: str) -> None:
    """Throughput against TTFT and ITL across the sweep's concurrencies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ttft_ms", "TTFT median (ms)"), (axes[1], "itl_ms", "ITL median (ms)")):
        xs = [r[key]["median"] for r in rows]
        ys = [r["output_throughput"] for r in rows]
        ax.plot(xs, ys, marker="o")
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(f"c={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel(label)
        ax.set_ylabel("output tok/s")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
