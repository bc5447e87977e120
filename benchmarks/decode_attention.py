"""The native decode attention of one 16-row step over every layer, per instruction-set level and source tree.

    python benchmarks/decode_attention.py [--contexts 64,300,600] [--rows 16] [--levels avx512-vnni,x86-64-v3]
        [--layout scattered] [--shape smollm2] [--repeats 15] [--threads 2]
        [--trees main=/path/to/other/src,branch=src] [--rounds 2] [--out benchmarks/results/decode_attention.md]

Shapes (`--shape`): smollm2 = SmolLM2-135M (30 layers, 9 query heads over 3 KV heads of 64), gemma3 = Gemma 3 270M
(18 layers, 4 over 1 KV head of 256); a float16 cache of 16-token blocks. Each layer has its own cache, as in the
engine, so a SmolLM2 step at 300 keys reads ~110 MB of K/V, more than a 32 MB last-level cache holds, as
compare.py's c=16 decode steps do (256 prompt tokens + up to 96 out); at 64 keys it reads ~24 MB, which such a
cache may hold. `--layout contiguous`: each sequence's blocks one after another, as right after its prefill;
`scattered`: the blocks in a random order, as after the pool has been used a while. One kernel call per layer,
`--repeats` steps, the median step's wall ms, and the K/V bytes the kernel reads (not the DRAM traffic) per
second of it. For scale, each child also times a plain 256 MB float16 sum on its threads (the host's streaming
rate). Each (tree, level) runs in its own process with LMSERVE_NATIVE_LEVEL and PYTHONPATH=tree, so it loads its
own kernel build (benchmarks/tree_levels.py): within a round the levels alternate, and the trees' order flips every
round. A level this CPU cannot run is skipped and named.
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

from packed_layout import cpu as cpu_line  # noqa: E402  (the CPU named the same way in every result)
from tree_levels import add_tree_args, run_children, runnable  # noqa: E402

SHAPES = {"smollm2": (30, 9, 3, 64), "gemma3": (18, 4, 1, 256)}  # layers, heads, KV heads, head dim
BLOCK = 16


def child(args: argparse.Namespace) -> dict:
    import lmserve  # noqa: I001  (before torch: the server's OpenMP wait policy)
    import torch
    from lmserve.layers.kernels.native import native_module

    torch.set_num_threads(args.threads)
    kernel = native_module()
    layers, heads, kv_heads, dim = SHAPES[args.shape]
    big = torch.ones(128 * 2**20, dtype=torch.float16)
    big.sum()
    t = time.perf_counter()
    for _ in range(5):
        big.sum()
    out: dict = {"module": kernel.__name__, "lmserve": lmserve.__file__,
                 "stream_gb_s": 5 * big.numel() * 2 / (time.perf_counter() - t) / 1e9}
    del big
    rows = args.rows
    for ctx in (int(c) for c in args.contexts.split(",")):
        per_seq = -(-ctx // BLOCK)
        gen = torch.Generator().manual_seed(0)
        caches = [torch.randn(2, rows * per_seq, BLOCK, kv_heads, dim, generator=gen).half() for _ in range(layers)]
        order = torch.arange(rows * per_seq) if args.layout == "contiguous" else torch.randperm(rows * per_seq,
                                                                                                generator=gen)
        tables = order.view(rows, per_seq)
        lens = torch.full((rows,), ctx, dtype=torch.long)
        q = torch.randn(rows, heads, dim, generator=gen)

        def step() -> None:
            for c in caches:
                kernel.paged_decode_attention(q, c[0], c[1], tables, lens, dim ** -0.5)

        step()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        kv_bytes = rows * ctx * kv_heads * dim * 2 * 2 * layers
        out[str(ctx)] = {"ms": ms, "gb_s": kv_bytes / ms / 1e6, "mb": kv_bytes / 1e6}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="64,300,600")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--layout", choices=("contiguous", "scattered"), default="scattered")
    ap.add_argument("--repeats", type=int, default=15)
    add_tree_args(ap, "avx512-vnni,x86-64-v3,x86-64-v2")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.child:
        sys.path.insert(0, os.environ["PYTHONPATH"].split(os.pathsep)[0])  # the tree under test, before this checkout
        print(json.dumps(child(args)))
        return
    sys.path.insert(0, str(ROOT / "src"))
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    levels, skipped = runnable(args.levels)
    load0 = os.getloadavg()[0]
    flags = [f"--{k}={getattr(args, k)}" for k in ("contexts", "rows", "shape", "layout", "repeats", "threads")]
    runs = run_children(__file__, flags, trees, levels, args.rounds)
    layers, heads, kv_heads, dim = SHAPES[args.shape]
    streams = [r["stream_gb_s"] for rs in runs.values() for r in rs]
    lines = [f"# Decode attention, {args.rows} rows x {layers} layers ({args.shape}: {heads} heads over {kv_heads} KV "
             f"heads of {dim}, float16 cache, {args.layout} blocks), {args.threads} threads", "",
             f"`python benchmarks/decode_attention.py {' '.join(sys.argv[1:])}`", "",
             f"CPU: {cpu_line()}; load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after; "
             f"{args.rounds} round(s), medians over rounds; ms per step (all layers), GB/s of K/V the kernel reads; "
             f"a plain float16 sum streams {statistics.median(streams):.1f} GB/s here (median of the children)"
             + (f"; skipped (this CPU lacks them): {', '.join(skipped)}" if skipped else ""), "",
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
        Path(args.out).with_suffix(".json").write_text(json.dumps(
            {"cpu": cpu_line(), "argv": sys.argv[1:], "trees": trees, "runs": table,
             "stream_gb_s": statistics.median(streams)}, indent=1))


if __name__ == "__main__":
    main()
