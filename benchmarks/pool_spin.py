"""How long the native kernels' workers should poll before they park (layers/kernels/csrc/thread_pool.h's PoolTuning).

    PYTHONPATH=src python benchmarks/pool_spin.py [--rounds 5] [--steps 24] [--streams 1,16]

One process, the embedded GGUF kept quantized, torch's threads. Each configuration (how long an idle worker polls
for the next job, and how long the caller spins for other threads' chunks before it parks) decodes `--steps` steps
per round, configurations interleaved round by round so that a shared machine's drift falls on all of them alike.
Two rhythms: steps back to back (offline decoding) and steps with a 2 ms pause between them (what a server's other
threads may take between steps). Reported per configuration: the median step, the process's CPU time per step (a
polling worker burns CPU that a neighbour may want), and wake-ups and parks per step. Writes
benchmarks/results/pool_spin.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_decode import cpu  # noqa: E402

from lmserve.config import CacheConfig, EngineConfig  # noqa: E402
from lmserve.engine.llm_engine import LLMEngine  # noqa: E402
from lmserve.layers.kernels.native import native_module  # noqa: E402
from lmserve.sampling_params import SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# name -> (worker_poll_us, caller_spin_us)
CONFIGS = {"park at once": (0, 0), "poll 50 us": (50, 100), "poll 200 us": (200, 100), "poll 1 ms": (1000, 100),
           "poll 5 ms": (5000, 100), "poll 1 ms, caller spins 1 ms": (1000, 1000)}
RHYTHMS = {"back to back": 0.0, "2 ms between steps": 0.002}


def run_steps(engine: LLMEngine, steps: int, gap: float, mod) -> dict:
    """`steps` decode steps of the running requests: per-step seconds, CPU seconds and pool counters."""
    before, cpu0, times = mod.pool_stats(), time.process_time(), []
    for _ in range(steps):
        if gap:
            time.sleep(gap)
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    after = mod.pool_stats()
    return {"times": times, "cpu_s": time.process_time() - cpu0,
            "counts": {k: after[k] - before[k] for k in after}}


def measure(streams: int, rounds: int, steps: int) -> dict:
    mod = native_module()
    engine = LLMEngine(EngineConfig(quantization="gguf", cache=CacheConfig(num_blocks=1024)))
    tokens = (rounds * len(CONFIGS) * len(RHYTHMS) + 2) * steps + 8
    for i in range(streams):
        engine.add_request(f"s{i}", [100 + (i * 7919 + j * 104729) % 30000 for j in range(32)],
                           SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    for _ in range(steps):  # prefill and warm-up
        engine.step()
    saved = mod.pool_tuning()
    rows = {(c, r): [] for c in CONFIGS for r in RHYTHMS}
    try:
        for _ in range(rounds):
            for cname, (poll, caller) in CONFIGS.items():
                mod.set_pool_tuning(**{**saved, "worker_poll_us": poll, "caller_spin_us": caller})
                for rname, gap in RHYTHMS.items():
                    rows[(cname, rname)].append(run_steps(engine, steps, gap, mod))
    finally:
        mod.set_pool_tuning(**saved)
    out = {}
    for (cname, rname), runs in rows.items():
        times = [t for r in runs for t in r["times"]]
        n = len(times)
        counts = {k: sum(r["counts"][k] for r in runs) / n for k in runs[0]["counts"]}
        out[f"{cname} | {rname}"] = {"median_step_ms": 1e3 * statistics.median(times),
                                     "cpu_ms_per_step": 1e3 * sum(r["cpu_s"] for r in runs) / n, **counts}
    return out


def to_markdown(meta: dict, results: dict) -> str:
    lines = [f"# Pool polling budget ({meta['cpu']['name']}, {meta['cpu']['cores']} cores, "
             f"{meta['threads']} threads, load average {meta['load_start']:.1f} -> {meta['load_end']:.1f})", ""]
    for streams, res in results.items():
        lines += [f"## {streams} stream(s)", "", "| configuration | rhythm | median step (ms) | CPU ms per step | "
                  "pool jobs per step | wake-ups per step | worker parks per step | caller parks per step |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in res.items():
            cname, rname = name.split(" | ")
            lines.append(f"| {cname} | {rname} | {r['median_step_ms']:.2f} | {r['cpu_ms_per_step']:.2f} | "
                         f"{r['jobs']:.0f} | {r['wakeups']:.2f} | {r['worker_parks']:.2f} | {r['caller_parks']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--out", default=str(RESULTS / "pool_spin"), help="path without suffix: .md and .json")
    a = ap.parse_args()
    import torch

    load0 = os.getloadavg()[0]
    results = {int(s): measure(int(s), a.rounds, a.steps) for s in a.streams.split(",")}
    meta = {"cpu": cpu(), "threads": torch.get_num_threads(), "load_start": load0, "load_end": os.getloadavg()[0],
            "rounds": a.rounds, "steps": a.steps}
    Path(a.out + ".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    text = to_markdown(meta, results)
    Path(a.out + ".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
