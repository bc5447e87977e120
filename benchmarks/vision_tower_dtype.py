"""One 512 px view through a SigLIP tower of SmolVLM-256M's shape (768 wide, 12 layers, 16 px patches: 1024 patches),
random weights, in float32 and in bfloat16: lmserve's tower as the runner holds it (models/vision/siglip.py, its
linears packed for oneDNN by the weight_format transform) beside transformers' SiglipVisionModel, rounds interleaved
so a busy neighbour skews every variant alike. What `--mm-encoder-dtype auto` chooses between on this CPU.

    python benchmarks/vision_tower_dtype.py [--threads 2] [--rounds 3]

Writes benchmarks/results/vision_tower_dtype.{json,md}: the best of each variant's rounds, and the load average.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import lmserve  # noqa: F401  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

# isort: split
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _seconds(fn, x: torch.Tensor) -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        fn(x)
        return time.perf_counter() - start


def variants() -> dict:
    """name -> (the tower's forward, its input dtype)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from lmserve.layers.formats.linear import can_pack, pack_linears
    from lmserve.models.config import VisionConfig
    from lmserve.models.vision.siglip import SiglipVisionTower

    torch.manual_seed(0)
    ours = SiglipVisionTower(VisionConfig(hidden_size=768, intermediate_size=3072, num_layers=12, num_heads=12,
                                          image_size=512, patch_size=16)).eval()
    hf = SiglipVisionModel(SiglipVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                              num_attention_heads=12, image_size=512, patch_size=16)).eval()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        tower = copy.deepcopy(ours).to(dtype)
        out[f"lmserve {name}"] = (pack_linears(tower) if can_pack(torch.device("cpu"), dtype) else tower, dtype)
        out[f"transformers {name}"] = (copy.deepcopy(hf).to(dtype), dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-dir", default=str(ROOT / "benchmarks/results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from lmserve.cpu_dtype import encoder_dtype_why

    runs = variants()
    x = torch.randn(1, 3, 512, 512, generator=torch.Generator().manual_seed(1))
    load = [os.getloadavg()[0]]
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn, dtype in runs.values():  # warm-up: oneDNN's kernels built
        _seconds(fn, x.to(dtype))
    for _ in range(args.rounds):
        for k, (fn, dtype) in runs.items():
            times[k].append(_seconds(fn, x.to(dtype)))
    load.append(os.getloadavg()[0])
    best = {k: min(v) for k, v in times.items()}
    auto, why = encoder_dtype_why("auto", torch.device("cpu"))
    result = {"threads": args.threads, "rounds": args.rounds, "seconds": times, "best_s": best,
              "loadavg_before_after": load, "auto": str(auto).removeprefix("torch."), "auto_why": why,
              "bf16_speedup_lmserve": best["lmserve float32"] / best["lmserve bfloat16"],
              "bf16_speedup_transformers": best["transformers float32"] / best["transformers bfloat16"]}
    out = Path(args.output_dir)
    (out / "vision_tower_dtype.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# One 512 px view through SmolVLM-256M's SigLIP tower: float32 against bfloat16", "",
             f"{args.threads} threads, best of {args.rounds} interleaved rounds, load average {load[0]:.1f} -> "
             f"{load[1]:.1f}. `--mm-encoder-dtype auto` here: {result['auto']} ({why}).", "",
             "| tower | float32 (s) | bfloat16 (s) | bf16 speed-up |", "|---|---|---|---|"]
    for who in ("lmserve", "transformers"):
        f, b = best[f"{who} float32"], best[f"{who} bfloat16"]
        lines.append(f"| {who} | {f:.3f} | {b:.3f} | {f / b:.2f}x |")
    (out / "vision_tower_dtype.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
