"""One decode row through SmolLM2-135M's LM head (49152 x 576) held four ways: bfloat16 coded in 12 bits a weight
(HalfLinear's default for a pre-quantized checkpoint's unquantized head: lossless), bfloat16 panels (the same head
uncoded), float32 panels (the skinny kernel) and Q8_0 blocks (a GGUF's table).

    python benchmarks/lm_head_kernels.py [--repeats 30]

Interleaved, median ms per call, with the bytes each reads and the rate that gives (random weights, seeded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import lmserve  # noqa: F401  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from lmserve.layers.formats.gguf_linear import GGUFLinear, kernel_layout, repack  # noqa: E402
from lmserve.layers.formats.half_linear import HalfLinear  # noqa: E402
from lmserve.layers.formats.linear import to_panels  # noqa: E402
from lmserve.layers.kernels.native import native_module  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    from gguf import GGMLQuantizationType, quants

    mod = native_module()
    w = torch.randn(49152, 576, generator=torch.Generator().manual_seed(0)) * 0.05
    coded, half, f32 = HalfLinear(w.bfloat16()), HalfLinear(w.bfloat16(), coded=False), to_panels(w)
    q8 = GGUFLinear(kernel_layout(repack("Q8_0", quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0), 49152, 576)),
                    576, None)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(1))
    assert torch.equal(coded(x), half(x))  # lossless: the same chains over the same values
    heads = {"bf16_coded": (lambda: coded(x), coded.coded.nbytes),
             "bf16": (lambda: half(x), half.half_panels.nbytes),
             "f32": (lambda: mod.skinny_linear(x, f32, 49152, None), f32.nbytes),
             "q8_0": (lambda: q8(x), sum(t.nbytes for t in (q8.codes, q8.scales)))}
    times = {k: [] for k in heads}
    load = os.getloadavg()
    for _ in range(args.repeats):
        for name, (run, _) in heads.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    out = {"load_avg_before": load, "load_avg_after": os.getloadavg(), "threads": torch.get_num_threads()}
    for name, (_, nbytes) in heads.items():
        ms = statistics.median(times[name]) * 1000
        out[name] = {"ms": round(ms, 2), "MB": round(nbytes / 1e6, 1), "GB_per_s": round(nbytes / ms / 1e6, 2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
