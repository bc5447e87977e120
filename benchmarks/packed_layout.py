"""The packed GGUF layout against the row layout, per instruction-set level: one layer, M = 1 and M = 16.

    PYTHONPATH=src python benchmarks/packed_layout.py [--levels x86-64-v3,x86-64-v2,avx512-vnni] \
        [--kinds Q4_1,Q8_0,Q6_K,Q4_K,Q5_K,IQ4_NL,Q3_K,Q2_K] [--rows 1536 --cols 576 --copies 16 --passes 5] \
        [--out benchmarks/results/packed_layout.md]

Each level runs in its own process (LMSERVE_NATIVE_LEVEL: a lower level runs on any newer CPU). Per GGUF type,
`--copies` layers of random valid blocks (default: the embedded SmolLM2's MLP up projection, 1536 x 576; 1536 x 768 for the
types whose blocks are 256 wide) are held
both ways: the row layout (one row's codes after another; what every level below AVX-512 VNNI read until now) and
the packed one (16 rows interleaved per block). Both are checked against the dequantize-then-matmul reference
first. Then M = 1 and M = 16 calls alternate layout by layout, pass by pass, so load moves both; a cell is the
median. The column that matters for batching is "16 rows / 1 row": what a 16-row decode step's matmuls cost in
1-row steps. The CPU, its flags and the load average are printed: numbers from a busy machine mean little.
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
sys.path.insert(0, str(ROOT))  # tests/: the random valid blocks
sys.path.insert(0, str(ROOT / "src"))

KINDS = "Q4_1,Q8_0,Q6_K,Q4_K,Q5_K,IQ4_NL,Q3_K,Q2_K"


def measure(kinds: list[str], n: int, cols: int, copies: int, passes: int) -> dict:
    """This process's level: {kind: {layout: {M: median us}}}."""
    import torch

    from lmserve.layers.formats import gguf_linear
    from lmserve.layers.formats.gguf_linear import GGUFLinear, reference_linear, repack
    from lmserve.layers.kernels.native import native_module
    from tests.test_gguf_linear import BLOCK_WEIGHTS, random_blocks

    out = {"module": native_module().__name__, "threads": torch.get_num_threads(), "kinds": {}}
    for kind in kinds:
        k = -(-cols // 256) * 256 if BLOCK_WEIGHTS[kind] == 256 else cols  # the K-quants' blocks are 256 wide
        xs = {m: torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in (1, 16)}
        layers: dict[str, list] = {"row": [], "packed": []}
        for i in range(copies):
            w = repack(kind, random_blocks(kind, n, k, seed=i), n, k)
            layers["packed"].append(GGUFLinear(w, k, None))
            saved, gguf_linear.kernel_layout = gguf_linear.kernel_layout, lambda w: w  # hold the row layout
            try:
                layers["row"].append(GGUFLinear(w, k, None))
            finally:
                gguf_linear.kernel_layout = saved
            if i == 0:
                ref = reference_linear(xs[16], w, None)
                for layout, group in layers.items():
                    got = group[0](xs[16])
                    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        assert layers["packed"][0].packed, f"{kind}: this build does not pack"
        times = {(lay, m): [] for lay in layers for m in xs}
        for _ in range(passes):
            for m, x in xs.items():
                for layout, group in layers.items():
                    for layer in group:
                        t0 = time.perf_counter()
                        layer(x)
                        times[layout, m].append((time.perf_counter() - t0) * 1e6)
        out["kinds"][kind] = {lay: {m: statistics.median(times[lay, m]) for m in xs} for lay in layers}
    return out


def cpu() -> str:
    name, flags = "?", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and name == "?":
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f in flags]
    return f"{name}, {os.cpu_count()} cores, flags {' '.join(shown)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="x86-64-v3,x86-64-v2,avx512-vnni")
    ap.add_argument("--kinds", default=KINDS)
    ap.add_argument("--rows", type=int, default=1536)
    ap.add_argument("--cols", type=int, default=576)
    ap.add_argument("--copies", type=int, default=16)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if args.child:  # one level, in this process
        print(json.dumps(measure(kinds, args.rows, args.cols, args.copies, args.passes)))
        return
    from lmserve.layers.kernels.native import pick_level
    from lmserve.utils import cpu_flags

    here = cpu_flags()
    lines = [f"# Packed vs row GGUF layout, one {args.rows} x {args.cols} layer, per level",
             "", f"CPU: {cpu()}; load average before {os.getloadavg()[0]:.1f}", "",
             "| level | type | row M=1 us | packed M=1 us | row M=16 us | packed M=16 us | "
             "16 rows / 1 row, row | 16 rows / 1 row, packed |", "|---|---|---|---|---|---|---|---|"]
    results: dict[str, dict] = {}
    for level in args.levels.split(","):
        try:
            pick_level(here, level)
        except ValueError as e:
            lines.append(f"| {level} | (not run: {e}) |||||||")
            continue
        env = dict(os.environ, LMSERVE_NATIVE_LEVEL=level, PYTHONPATH=str(ROOT / "src"))
        cmd = [sys.executable, __file__, "--child", "--kinds", args.kinds, "--rows", str(args.rows),
               "--cols", str(args.cols), "--copies", str(args.copies), "--passes", str(args.passes)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)  # a failing level's stderr is shown
        if res.returncode:
            sys.exit(f"{level} failed:\n{res.stderr}")
        got = json.loads(res.stdout.strip().splitlines()[-1])
        results[level] = got
        for kind, t in got["kinds"].items():
            r, p = t["row"], t["packed"]
            lines.append(f"| {level} | {kind} | {r['1']:.0f} | {p['1']:.0f} | {r['16']:.0f} | {p['16']:.0f} | "
                         f"{r['16'] / r['1']:.1f}x | {p['16'] / p['1']:.1f}x |")
    lines += ["", f"load average after {os.getloadavg()[0]:.1f}; threads: torch's default"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps({"cpu": cpu(), "levels": results}, indent=1))


if __name__ == "__main__":
    main()
