"""Skinny kernel (layers/kernels/csrc/gemv.cpp) vs oneDNN's packed GEMM for steps of 1..8 rows, float32 CPU.

    PYTHONPATH=src python benchmarks/skinny_rows.py [--threads 2] [--repeats 5] > benchmarks/results/skinny_rows.md

The shapes are the embedded model's (SmolLM2-135M) linear layers as lmserve runs them: q/k/v and gate/up are
fused into one layer each, and the tied LM head is a PackedLinear too. Each layer shape gets 30 random weight
copies (the model's 30 layers), used in turn, so the weights come from memory as in a real step and not
from a cache that a loop over one small matrix would keep warm. Every call is timed alone and a cell is
the median over all calls of `--repeats` passes (120 calls through the 30 layer copies, or 12 LM-head
calls), skinny and oneDNN alternating pass by pass, so bursts of other work on a shared machine move both
sides and the median little. "per step" sums 30 x (qkv + o + gate_up + down) + lm_head: the linear
layers' share of one forward with M rows, every row sampled (a verify step). SKINNY_MAX_ROWS in
layers/formats/linear.py should be the largest M up to which every shape reads faster with skinny.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lmserve  # noqa: F401  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

# isort: split
import torch
from compare import _cpu_name, _flags  # benchmarks/compare.py: the same machine description

from lmserve.layers.formats.linear import to_panels
from lmserve.layers.kernels.native import native_module

LAYERS = 30
SHAPES = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072), "down_proj": (1536, 576),
          "lm_head": (576, 49152)}  # name -> (in_features K, out_features N)


def onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def weights(k: int, n: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`copies` random [n, k] weights, each as (oneDNN packed, skinny panels)."""
    out = []
    for i in range(copies):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(i)) / k**0.5
        out.append((torch.ops.mkldnn._reorder_linear_weight(w), to_panels(w)))
    return out


def call_times_us(fn, x: torch.Tensor, ws: list, calls: int) -> list[float]:
    """Each call timed alone: a call that another process's burst stalls moves the median of many little."""
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(x, ws[i % len(ws)])
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def measure(k: int, n: int, rows: range, repeats: int) -> dict[int, tuple[float, float, bool]]:
    """M -> (skinny us, oneDNN us, skinny's bits == oneDNN's) for one layer shape."""
    mod = native_module()
    ws = weights(k, n, 1 if n > 10_000 else LAYERS)
    calls = 4 * len(ws) if len(ws) > 1 else 12  # a pass: 4 times through the layers, or 12 LM heads (~0.1 s)
    skinny = lambda x, w: mod.skinny_linear(x, w[1], n, None)  # noqa: E731
    dnn = lambda x, w: onednn(x, w[0])  # noqa: E731
    x8 = torch.randn(max(rows) + 9, k, generator=torch.Generator().manual_seed(99))
    full = onednn(x8, ws[0][0])  # more rows than any skinny step: oneDNN's GEMM path
    res = {}
    for m in rows:
        x = x8[:m].contiguous()
        same = torch.equal(skinny(x, ws[0]), full[:m])
        for fn in (skinny, dnn):  # warm-up
            call_times_us(fn, x, ws, len(ws))
        s, d = [], []
        for _ in range(repeats):
            s += call_times_us(skinny, x, ws, calls)
            d += call_times_us(dnn, x, ws, calls)
        res[m] = (statistics.median(s), statistics.median(d), same)
    return res


def table(results: dict[str, dict], rows: range) -> list[str]:
    head = "| layer (K -> N) | " + " | ".join(f"M={m}" for m in rows) + " |"
    lines = [head, "|" + " --- |" * (len(rows) + 1)]
    for name, res in results.items():
        k, n = SHAPES[name]
        cells = [f"{s:.0f} / {d:.0f} ({d / s:.2f}x){'' if same else ' DIFFERS'}" for s, d, same in
                 (res[m] for m in rows)]
        lines.append(f"| {name} ({k} -> {n}) | " + " | ".join(cells) + " |")
    step = {m: [LAYERS * sum(results[x][m][i] for x in SHAPES if x != "lm_head") + results["lm_head"][m][i]
                for i in (0, 1)] for m in rows}
    lines.append("| per step, ms | " + " | ".join(f"{s / 1e3:.1f} / {d / 1e3:.1f} ({d / s:.2f}x)"
                                                 for s, d in (step[m] for m in rows)) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-rows", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if native_module() is None:
        raise SystemExit("the native kernels could not be built here")
    rows = range(1, args.max_rows + 1)
    results = {name: measure(k, n, rows, args.repeats) for name, (k, n) in SHAPES.items()}
    wins = [m for m in rows if all(results[x][m][0] < results[x][m][1] for x in SHAPES)]
    best = max((m for m in rows if all(w in wins for w in range(1, m + 1))), default=0)
    print(f"Skinny kernel vs oneDNN, {_cpu_name()} ({_flags()}), float32, torch {torch.__version__}, "
          f"{args.threads} threads, median over every call of {args.repeats} passes\n")
    print("Microseconds per call, skinny / oneDNN (oneDNN time / skinny time); DIFFERS: skinny's bits are not "
          "oneDNN's for that M (the layer would keep oneDNN).\n")
    print("\n".join(table(results, rows)))
    print(f"\nSkinny is faster on every shape for M = 1..{best}: SKINNY_MAX_ROWS = {best}.")


if __name__ == "__main__":
    main()
