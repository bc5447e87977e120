"""A prompt's attention over the paged KV cache: its rows one by one (the decode-row path) against its tiles, per level.

    PYTHONPATH=src python benchmarks/prefill_attention.py [--levels x86-64-v3,x86-64-v2,avx512-vnni] [--threads 1]
        [--lengths 256,512,2000] [--out benchmarks/results/prefill_attention.md]

One layer of a causal prompt of N tokens, every token a row of `paged_decode_attention` over the keys before it:
with `table_rows` given the kernel runs a request's consecutive rows in tiles (each key and value row read and
widened once per tile); without, each row alone over its own copy of the block table, which is what a prefill ran
before a level had tiles. Both give the same bits (checked here and in tests/test_native_attention.py). Shapes:
SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64) and Gemma 3 270M's (4 / 1 / 256); float16 (the GGUF
default) and int8 caches. Each level runs in its own process (LMSERVE_NATIVE_LEVEL: a lower level runs on any newer
CPU); the time is the best of `--reps`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from packed_layout import cpu as cpu_line  # noqa: E402

SHAPES = {"SmolLM2 9/3 x 64": (9, 3, 64), "Gemma 3 4/1 x 256": (4, 1, 256)}


def child(lengths: list[int], threads: int, reps: int) -> list[dict]:
    import lmserve  # noqa: F401, I001  (before torch: the server's OpenMP wait policy)
    import torch

    from lmserve.layers.attention import kv_quant
    from lmserve.layers.kernels.native import native_module
    from lmserve.utils import KV_QUANT_DTYPES

    kernel = native_module()
    torch.set_num_threads(threads)
    out = []
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for dtype in ("float16", "int8"):
            for n in lengths:
                g = torch.Generator().manual_seed(n)
                blocks = n // 16 + 1
                values = torch.randn(2, blocks + 3, 16, kv_heads, dim, generator=g)
                cache = kv_quant.quantize(values, KV_QUANT_DTYPES[dtype]) if dtype in KV_QUANT_DTYPES else \
                    values.to(getattr(torch, dtype))
                table = torch.randperm(cache.shape[1], generator=g)[:blocks].view(1, blocks)
                rows = torch.zeros(n, dtype=torch.long)
                lens = torch.arange(1, n + 1)
                q = torch.randn(n, heads, dim, generator=g)
                per_row_tables = table[rows].contiguous()
                runs = {"rows": lambda: kernel.paged_decode_attention(q, cache[0], cache[1], per_row_tables, lens,
                                                                      dim ** -0.5, None, 0, 0.0),
                        "tiles": lambda: kernel.paged_decode_attention(q, cache[0], cache[1], table, lens,
                                                                       dim ** -0.5, rows, 0, 0.0)}
                best = {}
                for name, fn in runs.items():
                    fn()
                    best[name] = min(_timed(fn) for _ in range(reps))
                same = torch.equal(runs["rows"](), runs["tiles"]())
                out.append({"module": kernel.__name__, "shape": shape, "kv": dtype, "tokens": n,
                            "rows_ms": best["rows"] * 1e3, "tiles_ms": best["tiles"] * 1e3, "same_bits": same})
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="x86-64-v3,x86-64-v2,avx512-vnni")
    ap.add_argument("--lengths", default="256,512,2000")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/prefill_attention.md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        print(json.dumps(child(lengths, args.threads, args.reps)))
        return
    load0 = os.getloadavg()[0]
    results = {}
    for level in args.levels.split(","):
        env = dict(os.environ, LMSERVE_NATIVE_LEVEL=level, PYTHONPATH=str(ROOT / "src"))
        p = subprocess.run([sys.executable, __file__, "--child", "--lengths", args.lengths, "--threads",
                            str(args.threads), "--reps", str(args.reps)], env=env, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{level}: not run here ({p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode})")
            continue
        results[level] = json.loads(p.stdout.strip().splitlines()[-1])
    lines = ["# A prompt's attention, row by row against tiles, per level", "",
             f"CPU: {cpu_line()}; {args.threads} thread(s); load average {load0:.1f} before, "
             f"{os.getloadavg()[0]:.1f} after; best of {args.reps}; one layer, causal, every token a row.", "",
             "| level | shape | KV | tokens | rows ms | tiles ms | rows / tiles | same bits |",
             "|---|---|---|---|---|---|---|---|"]
    for level, rows in results.items():
        for r in rows:
            lines.append(f"| {level} | {r['shape']} | {r['kv']} | {r['tokens']} | {r['rows_ms']:.2f} | "
                         f"{r['tiles_ms']:.2f} | {r['rows_ms'] / r['tiles_ms']:.2f}x | {r['same_bits']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps({"cpu": cpu_line(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
