"""Where a decode step's time goes outside the decoder layers and the LM head: each host part of the step timed.

    python benchmarks/step_host_parts.py [--rows 1,16] [--steps 200] [--trees base=<checkout>/src,new=src]

An offline engine on the embedded SmolLM2 (2 threads) decodes `rows` greedy requests of 64-token prompts; after 10
warm-up steps, `--steps` steps run with a wall-clock wrapper around each part (the scheduler's schedule and update,
the runner's input building, upload, sampling metadata, sampler and download, the model's embedding lookup, rotary
tables and final norm, the layer loop, the LM head, the output processor). The wrappers nest (the layers are inside
the runner's step), so the parts are not a partition; they show what each costs a step, in the engine's own
sequence, where caches hold what a real step leaves in them. With --trees each tree runs in its own process, in turn.
The CPU's model name and its vector flags are printed with the results: numbers from another machine mean little.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def machine() -> str:
    """'<model name>, <n> cores, flags <the vector flags it has>' from /proc/cpuinfo (lmserve.utils reads the flags)."""
    from lmserve.utils import cpu_flags

    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown CPU")
    except OSError:
        name = "unknown CPU"
    have = set(cpu_flags().split())
    return f"{name}, {os.cpu_count()} cores, flags {' '.join(f for f in FLAGS if f in have)}"


def run(rows: int, steps: int) -> dict:
    import lmserve  # noqa: F401  before torch: the CLI's thread settings
    import lmserve.worker.model_runner as mr
    from lmserve.config import EngineConfig, SchedulerConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.loader.default_model import default_model_path
    from lmserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(default_model_path()), num_threads=2,
                                    scheduler=SchedulerConfig(max_num_seqs=rows)))
    spent: collections.Counter = collections.Counter()

    def wrap(owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t
        setattr(owner, name, timed)

    runner, model = engine.runner, engine.loaded.model
    for owner, name, key in ((engine.scheduler, "schedule", "scheduler.schedule"),
                             (engine.scheduler, "update", "scheduler.update"),
                             (engine.outputs, "process", "outputs.process"),
                             (mr, "build_inputs", "runner: build_inputs"), (mr, "to_device", "runner: upload"),
                             (runner.batch, "metadata", "runner: sampling metadata"),
                             (runner, "sampler", "runner: sampler"), (runner, "_collect", "runner: download"),
                             (model, "embed", "model: embedding lookup"),
                             (model.rotary, "forward", "model: rotary tables"),
                             (model.model.norm, "forward", "model: final norm"),
                             (model.layer_loop, "forward", "model: decoder layers"),
                             (model, "compute_logits", "model: LM head")):
        wrap(owner, name, key)
    for i in range(rows):
        engine.add_request(f"r{i}", [100 + i] * 64, SamplingParams(temperature=0.0, max_tokens=steps + 20,
                                                                   ignore_eos=True))
    for _ in range(10):
        engine.step()
    spent.clear()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    return {"rows": rows, "step_ms": step_ms, "parts_ms": {k: v / steps * 1e3 for k, v in spent.items()},
            "load": os.getloadavg()[0], "machine": machine()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--trees", default="", help="name=src_dir,...: each in its own process, in turn")
    ap.add_argument("--json", action="store_true", help="one JSON line per row count (used by --trees)")
    args = ap.parse_args()
    if not args.trees:
        for rows in (int(r) for r in args.rows.split(",")):
            out = run(rows, args.steps)
            if args.json:
                print(json.dumps(out), flush=True)
                continue
            print(f"\n{rows} row(s): step {out['step_ms']:.2f} ms (load {out['load']:.1f}; {out['machine']})")
            for key, ms in sorted(out["parts_ms"].items(), key=lambda kv: -kv[1]):
                print(f"  {key:28s} {ms:7.3f} ms")
        return
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    results = {}
    for name, src in trees.items():
        env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
        cmd = [sys.executable, __file__, "--json", "--rows", args.rows, "--steps", str(args.steps)]
        lines = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.splitlines()
        results[name] = [json.loads(line) for line in lines if line.startswith("{")]
    keys = sorted({k for rs in results.values() for r in rs for k in r["parts_ms"]})
    print(next(iter(results.values()))[0]["machine"])
    for i, rows in enumerate(int(r) for r in args.rows.split(",")):
        print(f"\n{rows} row(s), ms a step | " + " | ".join(trees))
        print(f"  {'whole step':28s} " + " ".join(f"{results[n][i]['step_ms']:8.3f}" for n in trees))
        for k in keys:
            print(f"  {k:28s} " + " ".join(f"{results[n][i]['parts_ms'].get(k, 0):8.3f}" for n in trees))


if __name__ == "__main__":
    main()
