"""Q2_K / Q3_K held near their file size (K2/K3, layers/formats/gguf_linear.py) vs the 4-bit table layout (I4) they had.

    PYTHONPATH=src python benchmarks/lowbit_layer.py [--rows 2048 --cols 2048 --copies 24 --passes 7] \
        > benchmarks/results/lowbit_layer.md

One linear layer of random valid blocks, held both ways: K2/K3 (2-bit codes, Q3_K's high-bit plane and the file's
integer scales per 16 under a float per 256) and I4 (each code as a 4-bit index into code - 8, a float scale and
Q2_K's float min per 16), both in the layout this machine's kernel reads. `--copies` matrices are used in turn, so
the weights come from memory as in a real step. Every M=1 call is timed alone; a cell is the median over all
calls, the two layouts alternating pass by pass, so bursts of other work move both sides. Both layers' outputs are
checked against the dequantize-then-matmul reference first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import lmserve  # noqa: F401  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the random valid blocks
from lmserve.layers.formats.gguf_linear import (  # noqa: E402
    BLOCK_BYTES,
    I4,
    K2,
    QK,
    GGUFLinear,
    Repacked,
    _codes_to_nibbles,
    _super_fields,
    reference_linear,
    repack,
)
from tests.test_gguf_linear import random_blocks  # noqa: E402


def as_i4(w: Repacked) -> Repacked:
    """The same weights in the I4 layout: values + 8 as nibbles, d * sc (and -dmin * m) as floats per 16."""
    crumbs, high, sc = _super_fields(w)
    n = crumbs.shape[0]
    values = crumbs.astype(np.int8) if w.kind == K2 else crumbs.astype(np.int8) + 4 * high.astype(np.int8) - 4
    codes = _codes_to_nibbles((values + 8).astype(np.uint8).reshape(n, -1, QK)).reshape(n, -1)
    d = np.repeat(w.scales, 16, axis=1)
    if w.kind == K2:
        mins = np.repeat(w.mins, 16, axis=1) * (sc >> 4).astype(np.float32)
        return Repacked(I4, codes, d * (sc & 0x0F).astype(np.float32), mins)
    return Repacked(I4, codes, d * sc.view(np.int8).astype(np.float32), None)


def held_bytes(layer: GGUFLinear) -> int:
    return sum(t.nbytes for t in (layer.codes, layer.scales, layer.mins) if t is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--copies", type=int, default=24)
    ap.add_argument("--passes", type=int, default=7)
    args = ap.parse_args()
    n, k = args.rows, args.cols
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
    print(f"# Q2_K / Q3_K: K2/K3 vs I4, one {n} x {k} layer, M = 1\n")
    print(f"threads {torch.get_num_threads()}, load average before {os.getloadavg()}\n")
    print("| type | file B/weight | held B/weight I4 | held B/weight K2/K3 | I4 us | K2/K3 us | K2/K3 / I4 time |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("Q2_K", "Q3_K"):
        new, old = [], []
        for i in range(args.copies):
            w = repack(kind, random_blocks(kind, n, k, seed=i), n, k)
            new.append(GGUFLinear(w, k, None))
            old.append(GGUFLinear(as_i4(w), k, None))
            if i == 0:  # both against the reference (and so against each other)
                ref = reference_linear(x, w, None)
                for layer in (new[0], old[0]):
                    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(args.passes):
            for name, layers in (("old", old), ("new", new)):
                for layer in layers * 4:
                    t0 = time.perf_counter()
                    layer(x)
                    times[name].append((time.perf_counter() - t0) * 1e6)
        t_old, t_new = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"| {kind} | {BLOCK_BYTES[kind] / 256:.3f} | {held_bytes(old[0]) / (n * k):.3f} | "
              f"{held_bytes(new[0]) / (n * k):.3f} | {t_old:.0f} | {t_new:.0f} | {t_new / t_old:.2f}x |")
    print(f"\nload average after {os.getloadavg()}; packed layout: {new[0].packed}")


if __name__ == "__main__":
    main()
