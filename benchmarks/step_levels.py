"""A decode step of 16 rows against a step of 1 row, per instruction-set level, on the embedded model.

    PYTHONPATH=src python benchmarks/step_levels.py [--levels x86-64-v3,x86-64-v2,avx512-vnni] [--threads 2]
        [--trees main=/path/to/other/src,branch=src] [--out benchmarks/results/step_levels.md]

Each (tree, level) runs in its own process with LMSERVE_NATIVE_LEVEL (a lower level runs on any newer CPU): 16
greedy requests of 32 prompt tokens decoding 40 tokens (EOS ignored), then 1 request; a step's wall and CPU
milliseconds are the medians over its steady decode steps (the first 4 and the last 2 left out). The CPU time
(this process, every thread) is what a step costs and holds up on a busy host, where the wall time also holds the
waits for a free core; on quiet cores the wall ratio is the one a user sees. `--threads` is the engine's
(default 2: lmserve's default on these 2-core machines). Levels and trees alternate in rounds (`--rounds`;
benchmarks/tree_levels.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from packed_layout import cpu as cpu_line  # noqa: E402  (the CPU named the same way in both results)
from tree_levels import add_tree_args, run_children, runnable  # noqa: E402


def child(threads: int) -> dict:
    import lmserve
    from lmserve.config import EngineConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.layers.kernels.native import native_module
    from lmserve.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(num_threads=threads))
    out: dict = {"module": native_module().__name__, "lmserve": lmserve.__file__}
    for batch in (16, 1):
        cpu, wall = [], []
        for it in range(2):  # the first pass warms the shapes up
            for i in range(batch):
                eng.add_request(f"b{batch}-{it}-{i}", [(7 * i + j + it) % 5000 + 10 for j in range(32)],
                                SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            n = 0
            while eng.has_unfinished():
                c0, w0 = time.process_time(), time.perf_counter()
                eng.step()
                c1, w1 = time.process_time(), time.perf_counter()
                n += 1
                if it and 4 < n < 38:
                    cpu.append((c1 - c0) * 1e3)
                    wall.append((w1 - w0) * 1e3)
        out[str(batch)] = {"cpu_ms": statistics.median(cpu), "wall_ms": statistics.median(wall)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_tree_args(ap, "x86-64-v3,x86-64-v2,avx512-vnni")
    args = ap.parse_args()
    if args.child:
        # the tree under test first: importing packed_layout (for cpu_line, above) put this checkout's src/ at the
        # front of sys.path, so until this line every --trees "A/B" ran this checkout's code in both processes
        sys.path.insert(0, os.environ["PYTHONPATH"].split(os.pathsep)[0])
        print(json.dumps(child(args.threads)))
        return
    sys.path.insert(0, str(ROOT / "src"))
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    load0 = os.getloadavg()[0]
    runs = run_children(__file__, ["--threads", str(args.threads)], trees, runnable(args.levels)[0], args.rounds)
    lines = [f"# 16-row vs 1-row decode step per level, embedded SmolLM2 Q4_1, {args.threads} threads", "",
             f"CPU: {cpu_line()}; load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after; "
             f"{args.rounds} round(s), medians over rounds", "",
             "| tree | level | 1 row wall ms | 16 rows wall ms | wall ratio | 1 row CPU ms | 16 rows CPU ms | CPU ratio |",
             "|---|---|---|---|---|---|---|---|"]
    table = {}
    for (tree, level), rs in runs.items():
        med = {b: {k: statistics.median(r[b][k] for r in rs) for k in ("cpu_ms", "wall_ms")} for b in ("1", "16")}
        table[f"{tree} {level}"] = med
        lines.append(f"| {tree} | {level} | {med['1']['wall_ms']:.1f} | {med['16']['wall_ms']:.1f} | "
                     f"{med['16']['wall_ms'] / med['1']['wall_ms']:.2f}x | {med['1']['cpu_ms']:.1f} | "
                     f"{med['16']['cpu_ms']:.1f} | {med['16']['cpu_ms'] / med['1']['cpu_ms']:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps({"cpu": cpu_line(), "threads": args.threads,
                                                                   "runs": table}, indent=1))


if __name__ == "__main__":
    main()
