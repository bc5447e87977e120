"""Single-stream decode: the embedded GGUF dequantized to float32 vs kept quantized (--quantization gguf).

    python benchmarks/gguf_decode.py [--tokens 96] [--repeats 3] [--out benchmarks/results/gguf_decode.json]

Both engines live in one process and alternate per repeat (same prompt, greedy, EOS ignored); the median
decode step of each repeat is reported with the CPU, its flags and the machine's load, since absolute
numbers from another machine or a busy one mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from lmserve.config import CacheConfig, EngineConfig  # noqa: E402
from lmserve.engine.llm_engine import LLMEngine  # noqa: E402
from lmserve.sampling_params import SamplingParams  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def cpu() -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), platform.processor())
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    return {"name": name, "cores": os.cpu_count(), "flags": [f for f in FLAGS if f in flags]}


def decode_step_ms(engine: LLMEngine, rid: str, tokens: int) -> float:
    """Median wall time of the decode steps of one greedy request (its prefill step excluded)."""
    engine.add_request(rid, PROMPT, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    engine.step()
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engines = {"float32": LLMEngine(EngineConfig(quantization="none", cache=CacheConfig(num_blocks=256))),
               "gguf": LLMEngine(EngineConfig(quantization="gguf", cache=CacheConfig(num_blocks=256)))}
    load_before = os.getloadavg()[0]
    steps = {name: [] for name in engines}
    for r in range(args.repeats):
        for name, engine in engines.items():
            steps[name].append(decode_step_ms(engine, f"r{r}", args.tokens))
    result = {"cpu": cpu(), "load_avg_before": load_before, "load_avg_after": os.getloadavg()[0],
              "tokens": args.tokens, "decode_step_ms": steps,
              "median_ms": {k: statistics.median(v) for k, v in steps.items()}}
    result["speedup"] = result["median_ms"]["float32"] / result["median_ms"]["gguf"]
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
