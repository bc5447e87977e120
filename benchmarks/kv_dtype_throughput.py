"""Decode throughput with long contexts by KV cache element type (issue 32: c=32 with 2,000-token prompts, int8 vs
float16 cache >= 1.0x).

    PYTHONPATH=src python benchmarks/kv_dtype_throughput.py [--streams 32] [--input-len 2000] [--output-len 64]
        [--dtypes float16,int8] [--rounds 2]

Offline, the embedded GGUF with its blocks kept, torch's threads. Each round runs every KV type in turn (a fresh
engine per type and round, the same prompts: random token ids, so no prefix is shared); per run: prefill seconds and
the decode phase's output tok/s (steps after every prompt is in; each step decodes every stream: with one
2,000-token prompt prefilled per step, the first stream has ~32 tokens out when the last prompt is in, so 64 tokens
out leave ~32 pure decode steps). The load average
is recorded: on a shared machine only the ratio within a round means much. Writes
benchmarks/results/kv_dtype_throughput.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_decode import cpu  # noqa: E402

from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from lmserve.engine.llm_engine import LLMEngine  # noqa: E402
from lmserve.sampling_params import SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def one_run(kv: str, streams: int, input_len: int, output_len: int) -> dict:
    tokens_needed = streams * (input_len + output_len)
    cache = CacheConfig(num_blocks=tokens_needed // 16 + streams + 16, kv_cache_dtype=kv, enable_prefix_caching=False)
    engine = LLMEngine(EngineConfig(quantization="gguf", cache=cache,
                                    scheduler=SchedulerConfig(max_num_seqs=streams, max_num_batched_tokens=2048)))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"{kv}-{i}", [1 + (i * 7919 + j * 104729) % 40000 for j in range(input_len)], params)
    start, steps, started = time.perf_counter(), [], set()
    while engine.has_unfinished():
        t = time.perf_counter()
        out = engine.step()
        elapsed = time.perf_counter() - t
        # A pure decode step of every stream: every prompt was in before this step (the step that finishes the
        # last prompt's prefill also returns a token for every stream, and holds a 2,000-token chunk).
        if len(started) == streams and len(out) == streams and all(len(d.token_ids) == 1 for d in out):
            steps.append(elapsed)
        started.update(d.request_id for d in out)
    total = time.perf_counter() - start
    decode_s = sum(steps)
    result = {"kv_bytes_per_token": engine.block_bytes // engine.block_size, "total_s": total,
              "prefill_s": total - decode_s, "decode_steps": len(steps),
              "decode_tok_s": streams * len(steps) / decode_s if steps else 0.0,
              "median_step_ms": 1e3 * statistics.median(steps) if steps else 0.0}
    del engine
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=2000)
    ap.add_argument("--output-len", type=int, default=64)  # streams prefill one a step: 32 decode steps follow the last
    ap.add_argument("--dtypes", default="float16,int8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "kv_dtype_throughput"), help="path without suffix: .md and .json")
    a = ap.parse_args()
    dtypes = a.dtypes.split(",")
    runs: dict[str, list[dict]] = {d: [] for d in dtypes}
    loads = [os.getloadavg()[0]]
    for _ in range(a.rounds):
        for d in dtypes:
            runs[d].append(one_run(d, a.streams, a.input_len, a.output_len))
            loads.append(os.getloadavg()[0])
            print(d, runs[d][-1], f"load {loads[-1]:.1f}", file=sys.stderr, flush=True)
    base = dtypes[0]
    summary = {d: {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                   "median_step_ms": statistics.median(r["median_step_ms"] for r in rs),
                   "prefill_s": statistics.median(r["prefill_s"] for r in rs),
                   "kv_bytes_per_token": rs[0]["kv_bytes_per_token"]} for d, rs in runs.items()}
    # a run too short to reach a pure decode step (output_len < streams) has no decode rate: its ratio is 0
    per_round = [{d: runs[d][i]["decode_tok_s"] / runs[base][i]["decode_tok_s"] if runs[base][i]["decode_tok_s"]
                  else 0.0 for d in dtypes} for i in range(a.rounds)]
    prefill_per_round = [{d: runs[d][i]["prefill_s"] / runs[base][i]["prefill_s"] for d in dtypes}
                         for i in range(a.rounds)]
    meta = {"cpu": cpu(), "streams": a.streams, "input_len": a.input_len, "output_len": a.output_len,
            "loadavg": loads}
    Path(a.out + ".json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs,
                                                 "ratio_per_round": per_round,
                                                 "prefill_ratio_per_round": prefill_per_round}, indent=2))
    lines = [f"# Decode with {a.input_len}-token prompts at {a.streams} streams, by KV cache type",
             "", f"{meta['cpu']['name']}, {meta['cpu']['cores']} cores ({' '.join(meta['cpu']['flags'])}); load average "
             f"during the runs {min(loads):.1f}-{max(loads):.1f}; {a.rounds} rounds, types interleaved; "
             f"{a.output_len} tokens out.", "",
             f"| KV cache | bytes/token | decode tok/s (median) | median step ms | prefill s | vs {base} per round "
             f"| prefill time vs {base} per round |",
             "|---|---|---|---|---|---|---|"]
    for d, s in summary.items():
        ratios = ", ".join(f"{r[d]:.2f}x" for r in per_round)
        prefill_ratios = ", ".join(f"{r[d]:.2f}x" for r in prefill_per_round)
        lines.append(f"| {d} | {s['kv_bytes_per_token']} | {s['decode_tok_s']:.1f} | {s['median_step_ms']:.1f} | "
                     f"{s['prefill_s']:.1f} | {ratios} | {prefill_ratios} |")
    text = "\n".join(lines) + "\n"
    Path(a.out + ".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
