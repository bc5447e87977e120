"""The native decode attention of one 16-row step over every layer, per instruction-set level and source tree.

    python benchmarks/decode_attention.py [--contexts 64,300,600] [--rows 16] [--levels avx512-vnni,x86-64-v3]
        [--trees main=/path/to/other/src,branch=src] [--rounds 2] [--out benchmarks/results/decode_attention.md]

SmolLM2-135M's attention shapes (30 layers, 9 query heads over 3 KV heads of 64, 16-token blocks, a float16
cache): each layer has its own cache, as in the engine, so a step at 300 keys streams ~110 MB of K/V, more than
the last-level cache holds, as compare.py's c=16 decode steps do (256 prompt tokens + up to 96 out). Each
sequence's blocks are contiguous, as after its prefill. One call per layer, `--repeats` steps; the median step's
wall ms and the K/V bytes it read per second. Each (tree, level) runs in its own process with
LMSERVE_NATIVE_LEVEL and PYTHONPATH=tree (its own kernel build); trees and levels alternate in rounds.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from packed_layout import cpu as cpu_line  # noqa: E402  (the CPU named the same way in every result)

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def child(rows: int, contexts: list[int], repeats: int, threads: int) -> dict:
    import lmserve  # noqa: I001  (before torch: the server's OpenMP wait policy)
    import torch
    from lmserve.layers.kernels.native import native_module

    torch.set_num_threads(threads)
    kernel = native_module()
    out: dict = {"module": kernel.__name__, "lmserve": lmserve.__file__}
    for ctx in contexts:
        per_seq = -(-ctx // BLOCK)
        gen = torch.Generator().manual_seed(0)
        caches = [torch.randn(2, rows * per_seq, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).half()
                  for _ in range(LAYERS)]
        tables = torch.arange(rows * per_seq).view(rows, per_seq)
        lens = torch.full((rows,), ctx, dtype=torch.long)
        q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)

        def step(caches: list = caches) -> None:
            for c in caches:
                kernel.paged_decode_attention(q, c[0], c[1], tables, lens, HEAD_DIM ** -0.5)

        step()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        kv_bytes = rows * ctx * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS
        out[str(ctx)] = {"ms": ms, "gb_s": kv_bytes / ms / 1e6, "mb": kv_bytes / 1e6}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="avx512-vnni,x86-64-v3,x86-64-v2")
    ap.add_argument("--contexts", default="64,300,600")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trees", default=f"this={ROOT / 'src'}", help="name=src-dir,... (compare two checkouts)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.child:
        sys.path.insert(0, os.environ["PYTHONPATH"].split(os.pathsep)[0])  # the tree under test, before this checkout
        print(json.dumps(child(args.rows, contexts, args.repeats, args.threads)))
        return
    sys.path.insert(0, str(ROOT / "src"))
    from lmserve.layers.kernels.native import pick_level
    from lmserve.utils import cpu_flags

    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    runs: dict[tuple[str, str], list[dict]] = {}
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for level in args.levels.split(","):
            try:
                pick_level(cpu_flags(), level)
            except ValueError:
                continue
            for tree, src in trees.items():
                env = dict(os.environ, LMSERVE_NATIVE_LEVEL=level, PYTHONPATH=src)
                res = subprocess.run([sys.executable, __file__, "--child", "--rows", str(args.rows), "--contexts",
                                      args.contexts, "--repeats", str(args.repeats), "--threads", str(args.threads)],
                                     env=env, capture_output=True, text=True)
                if res.returncode:
                    sys.exit(f"{tree} {level} failed:\n{res.stderr[-3000:]}")
                run = json.loads(res.stdout.strip().splitlines()[-1])
                if not Path(run["lmserve"]).resolve().is_relative_to(Path(src).resolve()):
                    sys.exit(f"{tree}: the child imported {run['lmserve']}, not {src}")
                runs.setdefault((tree, level), []).append(run)
    lines = [f"# Decode attention, {args.rows} rows x {LAYERS} layers (SmolLM2-135M shapes, float16 cache), "
             f"{args.threads} threads", "",
             f"CPU: {cpu_line()}; load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after; "
             f"{args.rounds} round(s), medians over rounds; ms per step (all layers), K/V GB/s read", "",
             "| tree | level | " + " | ".join(f"{c} keys: ms, GB/s" for c in contexts) + " |",
             "|---|---|" + "---|" * len(contexts)]
    table = {}
    for (tree, level), rs in runs.items():
        med = {c: {k: statistics.median(r[str(c)][k] for r in rs) for k in ("ms", "gb_s")} for c in contexts}
        table[f"{tree} {level}"] = med
        lines.append(f"| {tree} | {level} | " + " | ".join(f"{med[c]['ms']:.2f}, {med[c]['gb_s']:.1f}"
                                                             for c in contexts) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps({"cpu": cpu_line(), "rows": args.rows,
                                                                   "threads": args.threads, "runs": table}, indent=1))


if __name__ == "__main__":
    main()
