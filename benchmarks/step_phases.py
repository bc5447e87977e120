"""Where a c=N run's time goes, prefill steps and decode steps apart; and an interleaved A/B of source trees.

    python benchmarks/step_phases.py --model $GEMMA [--concurrency 16 --input-len 256 --output-len 64]
    python benchmarks/step_phases.py --model $GEMMA --trees main=/work/main/src,branch=src --rounds 3

The workload is compare.py's (N random-token prompts, greedy, ignore_eos) on the offline engine with 2 threads,
all N admitted at once. Every step's wall time is split into the decoder layers (the native stack or the module
loop), the LM head (compute_logits), the sampler and the rest (scheduler, inputs, Python); a step that holds
prompt tokens counts as prefill. With --trees each round runs every tree once in a fresh process, in turn
(PYTHONPATH=tree), so the trees share the machine's load; the table gives each tree's median output tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_once(args) -> dict:
    """Load the model, warm up, run the workload once; the phase split of prefill and decode steps."""
    from lmserve.config import EngineConfig, SchedulerConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.sample.sampler import Sampler
    from lmserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads,
                                    scheduler=SchedulerConfig(max_num_seqs=args.concurrency)))
    model, clock = engine.loaded.model, {"layers": 0.0, "head": 0.0, "sampler": 0.0}

    def timed(fn, key):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                clock[key] += time.perf_counter() - t
        return call

    model.layer_loop.forward = timed(model.layer_loop.forward, "layers")
    model.compute_logits = timed(model.compute_logits, "head")
    Sampler.__call__ = timed(Sampler.__call__, "sampler")
    vocab, rng = model.config.vocab_size, random.Random(args.seed)

    def workload(n: int, tag: str) -> tuple[float, list]:
        for i in range(n):
            ids = [rng.randrange(10, vocab) for _ in range(args.input_len)]
            engine.add_request(f"{tag}-{i}", ids, SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                                                 ignore_eos=True))
        steps, start = [], time.perf_counter()
        while engine.has_unfinished():
            prefill = any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
                bool(engine.scheduler.waiting)
            for k in clock:
                clock[k] = 0.0
            t = time.perf_counter()
            engine.step()
            steps.append((prefill, time.perf_counter() - t, dict(clock)))
        return time.perf_counter() - start, steps

    workload(2, "warm")
    wall, steps = workload(args.concurrency, "run")
    out = {"wall_s": wall, "output_tok_s": args.concurrency * args.output_len / wall, "load": os.getloadavg()[0]}
    for name, want in (("prefill", True), ("decode", False)):
        group = [s for s in steps if s[0] == want]
        total = sum(s[1] for s in group)
        parts = {k: sum(s[2][k] for s in group) for k in clock}
        out[name] = {"steps": len(group), "total_s": total, **{f"{k}_s": v for k, v in parts.items()},
                     "rest_s": total - sum(parts.values())}
    return out


def table(out: dict) -> str:
    lines = [f"c={out.get('concurrency', '?')}: {out['output_tok_s']:.1f} output tok/s, wall {out['wall_s']:.2f} s, "
             f"load {out['load']:.1f}", "", "| steps | n | total s | layers | LM head | sampler | rest |",
             "|---|---|---|---|---|---|---|"]
    for name in ("prefill", "decode"):
        p, n = out[name], max(out[name]["steps"], 1)
        lines.append(f"| {name} | {p['steps']} | {p['total_s']:.2f} | " + " | ".join(
            f"{p[k + '_s'] / n * 1000:.1f} ms" for k in ("layers", "head", "sampler", "rest")) + " |")
    return "\n".join(lines)


def ab(args) -> None:
    """Each round, every tree once in a fresh process, in turn; medians per tree."""
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    results = {name: [] for name in trees}
    base = [sys.executable, __file__, "--json", "--concurrency", str(args.concurrency), "--input-len",
            str(args.input_len), "--output-len", str(args.output_len), "--threads", str(args.threads)]
    base += ["--model", str(args.model)] if args.model else []
    for r in range(args.rounds):
        for name, src in trees.items():
            env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
            res = subprocess.run(base + ["--seed", str(r)], env=env, capture_output=True, text=True, check=True)
            results[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"round {r} {name}: {results[name][-1]['output_tok_s']:.1f} tok/s "
                  f"(load {results[name][-1]['load']:.1f})", flush=True)
    print("\n| tree | output tok/s per round | median | prefill s | decode ms/step | of which sampler ms |\n"
          "|---|---|---|---|---|---|")
    for name, rs in results.items():
        def per_decode(key: str) -> float:
            return statistics.median(x["decode"][key] / max(x["decode"]["steps"], 1) * 1000 for x in rs)
        per_round = ", ".join(f"{x['output_tok_s']:.1f}" for x in rs)
        print(f"| {name} | {per_round} | {statistics.median(x['output_tok_s'] for x in rs):.1f} | "
              f"{statistics.median(x['prefill']['total_s'] for x in rs):.2f} | {per_decode('total_s'):.1f} | "
              f"{per_decode('sampler_s'):.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trees", default="", help="name=src_dir,... : interleaved A/B of source trees")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON line (used by --trees)")
    args = ap.parse_args()
    if args.trees:
        return ab(args)
    out = run_once(args) | {"concurrency": args.concurrency}
    print(json.dumps(out) if args.json else table(out))


if __name__ == "__main__":
    main()
