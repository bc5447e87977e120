"""The CPU a `serve` spends between its imports and its model being ready, in-process; and an A/B of source trees.

    python benchmarks/start_phases.py [--model PATH]
    python benchmarks/start_phases.py --trees main=/tmp/main/src,branch=src --rounds 6

Everything `serve` imports is imported first; then `prepare()` (the serve flags' checks: the GGUF header parse,
the engine config) and `build_engine` (the model load from the start cache, the tokenizer, the KV pool) are timed,
CPU and wall seconds each (startup.py times the whole start from outside). With --trees each round runs every tree
once in a fresh process, in turn (PYTHONPATH=tree), so the trees share the machine's load; the table gives each
tree's median. Both trees must use the same start cache (LMSERVE_WEIGHT_CACHE): run each once first to fill it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_once(model: str | None) -> dict:
    """CPU and wall seconds of prepare() and of build_engine, after every import."""
    from lmserve.cli import build_parser
    from lmserve.engine.build import build_engine
    from lmserve.server import app  # noqa: F401  (the routes' imports, as `serve` has them before a request)
    from lmserve.server.main import prepare

    args = build_parser().parse_args(["serve", "--num-threads", "2"] + (["--model", model] if model else []))
    out = {}
    cpu, wall = time.process_time(), time.perf_counter()
    state = prepare(args)
    out["prepare"] = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}
    cpu, wall = time.process_time(), time.perf_counter()
    build_engine(state.models.default.spec.config)
    out["build_engine"] = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}
    return out | {"load": os.getloadavg()[0]}


def ab(trees: str, rounds: int, model: str | None) -> None:
    """Each round, every tree once in a fresh process, in turn; medians per tree."""
    named = dict(t.split("=", 1) for t in trees.split(","))
    results: dict[str, list[dict]] = {name: [] for name in named}
    cmd = [sys.executable, __file__, "--json"] + (["--model", model] if model else [])
    for r in range(rounds):
        for name, src in named.items():
            env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
            x = results[name][-1]
            print(f"round {r} {name}: prepare {x['prepare']['cpu_s']:.3f} CPU s, build_engine "
                  f"{x['build_engine']['cpu_s']:.3f} CPU s (load {x['load']:.1f})", flush=True)
    print("\n| tree | prepare CPU s | build_engine CPU s | both, CPU s | both, wall s |\n|---|---|---|---|---|")
    for name, rs in results.items():
        def median(phase: str, clock: str = "cpu_s") -> float:
            return statistics.median(x[phase][clock] for x in rs)

        both = statistics.median(x["prepare"]["cpu_s"] + x["build_engine"]["cpu_s"] for x in rs)
        both_wall = statistics.median(x["prepare"]["wall_s"] + x["build_engine"]["wall_s"] for x in rs)
        print(f"| {name} | {median('prepare'):.3f} | {median('build_engine'):.3f} | {both:.3f} | {both_wall:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--trees", default="", help="name=src_dir,... : interleaved A/B of source trees")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", action="store_true", help="print one JSON line (used by --trees)")
    args = ap.parse_args()
    if args.trees:
        return ab(args.trees, args.rounds, args.model)
    out = run_once(args.model)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
