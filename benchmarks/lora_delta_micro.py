"""The native LoRA delta alone (csrc/lora_delta.cpp) on the embedded SmolLM2's decode shapes: 32 rows over 8
rank-16 adapters, per projection and per 30-layer step, in thread CPU time (less moved by other jobs than wall time).

    python benchmarks/lora_delta_micro.py [rows]     # LMSERVE_NATIVE_LEVEL=x86-64-v2 for the lower build

A and B stay in cache here (one layer's slots); in a real step each adapter's are read from memory once.
"""

from __future__ import annotations

import sys
import time

import lmserve  # noqa: F401  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

# isort: split
import torch

from lmserve.layers.kernels.native import native_module

SHAPES = {"qkv": (576, [576, 192, 192]), "o": (576, [576]), "gate_up": (576, [1536, 1536]), "down": (1536, [576])}


def main() -> None:
    torch.set_num_threads(1)
    mod = native_module()
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(rows) % 8
    total = 0.0
    for name, (inp, outs) in SHAPES.items():
        a = torch.randn(8, 16, len(outs), inp, generator=g) / inp ** 0.5  # [max_loras, max_rank, n, in]
        bs = [torch.randn(8, 16, o, generator=g) * 0.01 for o in outs]
        x, y = torch.randn(rows, inp, generator=g), torch.zeros(rows, sum(outs))
        for _ in range(3):
            mod.lora_delta_(y, x, slots, a, bs, 16)
        n, start = 30, time.thread_time()
        for _ in range(n):
            mod.lora_delta_(y, x, slots, a, bs, 16)
        dt = (time.thread_time() - start) / n
        total += dt
        print(f"{name:8s} {dt * 1e3:7.3f} ms  {rows * 16 * (len(outs) * inp + sum(outs)) / dt / 1e9:6.2f} GMAC/s")
    print(f"per layer {total * 1e3:.2f} ms, x30 layers = {total * 30e3:.1f} ms per step ({rows} rows)")


if __name__ == "__main__":
    main()
