"""Offline decode throughput on a shared CPU: idle vs one busy neighbour, for several thread settings.

    PYTHONPATH=src python benchmarks/busy_neighbour.py [--output-len 16] [--streams 16]

writes benchmarks/results/busy_neighbour.md and .json. Each configuration runs in its own process, since
libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once, when torch loads it. A configuration is measured
idle, then with a neighbour: another process spinning one core in a tight Python loop (what a test run
or a build next door looks like). Each child also records how many cores other processes kept busy
while it measured (the neighbour counts: ~1.0 when it alone runs), since colleagues' jobs on a shared
machine disturb "idle" too. Two numbers per run: `--streams` prompts decoded together (output
tok/s, prefill excluded) and one stream alone (ms per output token, TPOT).

"libgomp default" is the policy torch had before lmserve chose one: GOMP_SPINCOUNT=300000 is what
libgomp uses when neither variable is set (~3 ms of spinning at every barrier before sleeping).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from compare import _cpu_name, _flags  # benchmarks/compare.py: the same machine description

RESULTS = Path(__file__).parent / "results"
# name -> (environment, num_threads or None for the engine's default)
CONFIGS: dict[str, tuple[dict[str, str], int | None]] = {
    "libgomp default, torch threads": ({"GOMP_SPINCOUNT": "300000"}, None),
    "libgomp default, 1 thread": ({"GOMP_SPINCOUNT": "300000"}, 1),
    "PASSIVE, torch threads (lmserve default)": ({"OMP_WAIT_POLICY": "PASSIVE"}, None),
    "PASSIVE, 1 thread": ({"OMP_WAIT_POLICY": "PASSIVE"}, 1),
    "GOMP_SPINCOUNT=100000, torch threads (dedicated host)": ({"GOMP_SPINCOUNT": "100000"}, None),
}

CHILD = r"""
import json, statistics, sys, time
import lmserve
from lmserve import LLM, SamplingParams
from lmserve.bench.report import cpu_sample, others_load
import torch
a = json.loads(sys.argv[1])
llm = LLM(num_threads=a["threads"], kv_cache_memory=128 * 2**20, max_num_seqs=a["streams"])
eng = llm.engine
prompts = [[100 + (i * 7919 + j * 104729) % 30000 for j in range(32)] for i in range(a["streams"])]
def decode_steps(batch, n):
    # Per-step seconds of the decode steps only (the first step is the prefill).
    for i, p in enumerate(batch):
        eng.add_request(f"r{time.perf_counter_ns()}-{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    times, t = [], time.perf_counter()
    eng.step(); t = time.perf_counter()
    while eng.has_unfinished():
        eng.step(); now = time.perf_counter(); times.append(now - t); t = now
    return times
decode_steps(prompts, 4); decode_steps(prompts[:1], 4)  # warm-up: one-time costs of both shapes
s0 = cpu_sample()
many = decode_steps(prompts, a["output_len"])
one = decode_steps(prompts[:1], a["output_len"])
print(json.dumps({"threads": torch.get_num_threads(), "streams_tok_s": a["streams"] * len(many) / sum(many),
                  "single_tpot_ms": 1e3 * statistics.median(one),
                  "other_processes_cores": others_load(s0, cpu_sample())["other_processes_cores"]}))
"""

SPIN = "import time\nwhile True:\n    pass\n"


def run_config(env: dict[str, str], threads: int | None, streams: int, output_len: int) -> dict:
    """One configuration in a fresh process: its measurements and wall time."""
    start = time.perf_counter()
    child_env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    child_env.update(env, PYTHONWARNINGS="ignore")
    arg = json.dumps({"threads": threads, "streams": streams, "output_len": output_len})
    proc = subprocess.run([sys.executable, "-c", CHILD, arg], env=child_env, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - start
    return out


def measure_all(streams: int, output_len: int) -> dict:
    """Every configuration idle, then every configuration beside one spinning neighbour."""
    rows: dict = {name: {} for name in CONFIGS}
    for condition in ("idle", "busy neighbour"):
        neighbour = subprocess.Popen([sys.executable, "-c", SPIN]) if condition != "idle" else None
        try:
            for name, (env, threads) in CONFIGS.items():
                load = os.getloadavg()[0]
                rows[name][condition] = {**run_config(env, threads, streams, output_len), "loadavg_1m": load}
                print(f"{condition:15} {name:42} {rows[name][condition]}", file=sys.stderr, flush=True)
        finally:
            if neighbour:
                neighbour.kill()
                neighbour.wait()
    return rows


def machine() -> dict:
    import torch

    return {"cpu": _cpu_name(), "flags": _flags(), "cpu_count": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "python": platform.python_version(), "torch": torch.__version__,
            "parallel": torch.__config__.parallel_info().splitlines()[-1].strip()}


def to_markdown(meta: dict, rows: dict, streams: int) -> str:
    """One table: each configuration idle and beside a busy neighbour, and the ratio."""
    lines = [f"# Decode on a shared CPU: idle vs one busy neighbour\n",
             f"{meta['machine']['cpu']} ({meta['machine']['affinity']} cores usable; {meta['machine']['flags']}), "
             f"torch {meta['machine']['torch']}, {meta['machine']['parallel']}. "
             f"Load average (1 min) before the run {meta['loadavg_start']:.2f}, after {meta['loadavg_end']:.2f}; "
             f"output length {meta['output_len']}, run took {meta['wall_s']:.0f} s.\n",
             f"| configuration | threads | {streams} streams idle (tok/s) | {streams} streams busy (tok/s) "
             f"| busy / idle | 1 stream idle (ms/token) | 1 stream busy (ms/token) "
             f"| other processes' cores, idle / busy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        idle, busy = r["idle"], r["busy neighbour"]
        lines.append(f"| {name} | {idle['threads']} | {idle['streams_tok_s']:.1f} | {busy['streams_tok_s']:.1f} | "
                     f"{busy['streams_tok_s'] / idle['streams_tok_s']:.2f}x | {idle['single_tpot_ms']:.1f} | "
                     f"{busy['single_tpot_ms']:.1f} | {idle['other_processes_cores']:.1f} / {busy['other_processes_cores']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--out", default=str(RESULTS / "busy_neighbour"), help="path without suffix: .md and .json")
    a = ap.parse_args()
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    rows = measure_all(a.streams, a.output_len)
    meta = {"machine": machine(), "loadavg_start": load0, "loadavg_end": os.getloadavg()[0],
            "streams": a.streams, "output_len": a.output_len, "wall_s": time.perf_counter() - start,
            "configs": {name: {"env": env, "num_threads": t} for name, (env, t) in CONFIGS.items()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    Path(a.out + ".md").write_text(to_markdown(meta, rows, a.streams))
    print(to_markdown(meta, rows, a.streams))


if __name__ == "__main__":
    main()
