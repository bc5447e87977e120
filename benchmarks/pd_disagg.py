"""Disaggregated prefill/decode on Ray Serve (issue 48): decode inter-token latency while long prompts arrive, 1 prefill
+ 1 decode replica against 2 colocated replicas, on the embedded model and a local 2-CPU Ray cluster.

    python benchmarks/pd_disagg.py [--prompt-words 1500] [--interval 2] [--duration 40] [--streams 8] [--pin]

Per set-up, a fresh Ray cluster (num_cpus 2) runs lmserve.deploy.ray_serve:app with 1-thread replicas: `pd` is
prefill_replicas=1, num_replicas=1 over a redis-server (started here) as the shared KV tier; `colocated` is
num_replicas=2. The load, for `--duration` seconds after a warm-up: `--streams` streamed completions with short
prompts, each asking 48 tokens (ignore_eos) and starting again when done, and every `--interval` seconds a streamed
completion with a fresh ~2,000-token prompt (its first words unique, so no prefix is shared) asking 16 tokens.
Reported per set-up: the decode streams' inter-token latency (the gaps between their SSE chunks; p50, p99), their
tokens/s, the long prompts' TTFT and how many finished, and total generated tokens/s; with `--pin` each replica's
threads are pinned to its own core (sched_setaffinity on every thread of its actor process). The machine may be
shared: the load average is noted before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from kv_tier_ttft import _cpu_model, system_prompt  # noqa: E402

from tests.redis_server import redis_server  # noqa: E402
from tests.server_util import free_port  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def start_app(setup: str, redis_url: str | None, tmp: str, pin: bool, start_timeout: float) -> str:
    """Serve's URL, with the set-up's application running (and its replicas pinned, with `pin`)."""
    import ray
    from ray import serve

    from lmserve.deploy.ray_serve import app

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    flags = f"--kv-cache-memory {256 * 2**20} --no-playground --batch-dir {tmp}/batches --log-level warning"
    args = {"num_threads": "1", "num_replicas": "2", "max_ongoing_requests": "64"}
    if setup == "pd":
        args |= {"num_replicas": "1", "prefill_replicas": "1", "pd_min_prompt_chars": "2000",
                 "pd_start_timeout_s": str(start_timeout), "pd_timeout_s": "300"}
        flags += f" --kv-shared {redis_url}"
    serve.run(app(args | {"serve_args": flags}), name="lmserve", route_prefix="/")
    if pin:
        pin_replicas()
    return f"http://127.0.0.1:{port}"


def pin_replicas() -> None:
    """Each engine replica's threads onto one core of its own (0, 1, ...)."""
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith("SERVE_REPLICA::lmserve#LMServer"))
    for core, name in enumerate(names):
        actor = ray.get_actor(name, namespace="serve")
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {core % os.cpu_count()})
        print(f"pinned {name} (pid {pid}) to core {core}", file=sys.stderr)


def stop_app() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


async def stream(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> list[float]:
    """The arrival times of a streamed completion's chunks (one token each), from the request's start."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times, t0 = [], time.perf_counter()
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"text"' in line:
                times.append(time.perf_counter() - t0)
    return times


async def run_load(url: str, long_prompt: str, streams: int, interval: float, duration: float) -> dict:
    """Decode streams and long prompts for `duration` seconds; what each produced."""
    decode: list[list[float]] = []
    longs: list[list[float]] = []
    stop = time.perf_counter() + duration
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200)) as http:
        await stream(http, url, "Warm-up.", 2)

        async def decoder(i: int) -> None:
            n = 0
            while time.perf_counter() < stop:
                decode.append(await stream(http, url, f"Stream {i}.{n}: tell a story about a lighthouse.", 48))
                n += 1

        async def arrivals() -> None:
            tasks, k = [], 0
            while time.perf_counter() < stop:
                tasks.append(asyncio.create_task(stream(http, url, f"Document {k} {time.time()}. {long_prompt}", 16)))
                k += 1
                await asyncio.sleep(interval)
            longs.extend(await asyncio.gather(*tasks))

        t0 = time.perf_counter()
        await asyncio.gather(arrivals(), *(decoder(i) for i in range(streams)))
        wall = time.perf_counter() - t0
        health = (await http.get(url + "/health")).json()
    gaps = sorted(b - a for times in decode for a, b in zip(times, times[1:]))
    decode_tokens = sum(len(t) for t in decode)
    long_tokens = sum(len(t) for t in longs)
    return {"wall_s": wall, "itl_p50_ms": 1000 * statistics.median(gaps),
            "itl_p99_ms": 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "decode_tokens_per_s": decode_tokens / wall, "long_prompts": len(longs),
            "long_ttft_p50_s": statistics.median(t[0] for t in longs if t),
            "total_tokens_per_s": (decode_tokens + long_tokens) / wall, "pd": health.get("pd")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-words", type=int, default=1500, help="words of the long prompts (~1.3 tokens each)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between long prompts")
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--pin", action="store_true", help="pin each replica's threads to its own core")
    ap.add_argument("--setups", default="pd,colocated")
    ap.add_argument("--pd-start-timeout", type=float, default=2.0,
                    help="the app's pd_start_timeout_s (raise it on an overloaded machine, where a replica's event "
                         "loop may take seconds to take a prompt)")
    ap.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/pd_disagg")
    args = ap.parse_args()
    long_prompt = system_prompt(args.prompt_words)
    load_before = os.getloadavg()
    results = {}
    with redis_server() as srv:
        for setup in args.setups.split(","):
            tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
            try:
                url = start_app(setup, srv.url, tmp, args.pin, args.pd_start_timeout)
                results[setup] = asyncio.run(run_load(url, long_prompt, args.streams, args.interval, args.duration))
            finally:
                stop_app()
                shutil.rmtree(tmp, ignore_errors=True)
            print(setup, json.dumps(results[setup]), file=sys.stderr, flush=True)
    result = {"args": vars(args) | {"output": str(args.output)}, "results": results, "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "cpus": os.cpu_count(), "cpu": _cpu_model() or platform.processor(),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.output.with_suffix(".md").write_text(report(result))
    print(report(result))
    return 0


def report(r: dict) -> str:
    a = r["args"]
    lines = [f"# P/D on Ray Serve: decode ITL while long prompts arrive (`{r['command']}`)", "",
             f"Embedded SmolLM2-135M, 1-thread replicas on a local Ray cluster of 2 CPUs (machine: {r['cpus']} CPUs, {r['cpu']}"
             f"){', each replica pinned to its own core' if a['pin'] else ', replicas not pinned'}. Load: "
             f"{a['streams']} streamed decodes of 48 tokens, restarted when done, and a {a['prompt_words']}-word prompt "
             f"(16 tokens asked) every {a['interval']} s, for {a['duration']} s. Load average "
             f"{r['load_average_before'][0]:.1f} before, {r['load_average_after'][0]:.1f} after.", "",
             "| set-up | decode ITL p50 | decode ITL p99 | decode tok/s | long prompts | long TTFT p50 | total tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for setup, s in r["results"].items():
        lines.append(f"| {setup} | {s['itl_p50_ms']:.0f} ms | {s['itl_p99_ms']:.0f} ms | {s['decode_tokens_per_s']:.1f}"
                     f" | {s['long_prompts']} | {s['long_ttft_p50_s']:.1f} s | {s['total_tokens_per_s']:.1f} |")
    res = r["results"]
    if {"pd", "colocated"} <= set(res):
        lines += ["", f"pd / colocated: ITL p99 {res['pd']['itl_p99_ms'] / res['colocated']['itl_p99_ms']:.2f}x "
                  f"(target <= 0.5x), total throughput "
                  f"{res['pd']['total_tokens_per_s'] / res['colocated']['total_tokens_per_s']:.2f}x (target >= 0.9x). "
                  f"P/D figures from the ingress's /health: {json.dumps(res['pd']['pd'])}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
