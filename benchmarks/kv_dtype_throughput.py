"""Decode throughput with long contexts by KV cache element type (issue 32: c=32 with 2,000-token prompts, int8 vs
float16 cache >= 1.0x).

    PYTHONPATH=src python benchmarks/kv_dtype_throughput.py [--streams 32] [--input-len 2000] [--output-len 64]
        [--dtypes float16,int8] [--rounds 2] [--paired]

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


class Run:
    """One engine of one KV type with the benchmark's prompts, stepped by the caller: each step's time is summed
    into prefill (until every prompt is in) or kept as a pure decode step."""

    def __init__(self, kv: str, streams: int, input_len: int, output_len: int):
        tokens_needed = streams * (input_len + output_len)
        cache = CacheConfig(num_blocks=tokens_needed // 16 + streams + 16, kv_cache_dtype=kv,
                            enable_prefix_caching=False)
        self.engine = LLMEngine(EngineConfig(quantization="gguf", cache=cache, scheduler=SchedulerConfig(
            max_num_seqs=streams, max_num_batched_tokens=2048)))
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for i in range(streams):
            self.engine.add_request(f"{kv}-{i}", [1 + (i * 7919 + j * 104729) % 40000 for j in range(input_len)],
                                    params)
        self.streams, self.total, self.steps, self.started = streams, 0.0, [], set()

    def step(self) -> None:
        t = time.perf_counter()
        out = self.engine.step()
        elapsed = time.perf_counter() - t
        self.total += elapsed
        # A pure decode step of every stream: every prompt was in before this step (the step that finishes the
        # last prompt's prefill also returns a token for every stream, and holds a 2,000-token chunk).
        if len(self.started) == self.streams and len(out) == self.streams and all(len(d.token_ids) == 1 for d in out):
            self.steps.append(elapsed)
        self.started.update(d.request_id for d in out)

    def result(self) -> dict:
        decode_s = sum(self.steps)
        return {"kv_bytes_per_token": self.engine.block_bytes // self.engine.block_size, "total_s": self.total,
                "prefill_s": self.total - decode_s, "decode_steps": len(self.steps),
                "decode_tok_s": self.streams * len(self.steps) / decode_s if self.steps else 0.0,
                "median_step_ms": 1e3 * statistics.median(self.steps) if self.steps else 0.0}


def one_run(kv: str, streams: int, input_len: int, output_len: int) -> dict:
    run = Run(kv, streams, input_len, output_len)
    while run.engine.has_unfinished():
        run.step()
    result = run.result()
    del run
    gc.collect()
    return result


def paired_runs(dtypes: list[str], streams: int, input_len: int, output_len: int) -> dict[str, dict]:
    """--paired: one engine per type side by side, stepped in turn (a float16 step, an int8 step, ...): on a shared
    machine whose load swings within a minute, whole runs one after the other compared different loads (prefill
    ratios of 0.67x and 1.05x in two rounds of one invocation); steps seconds apart see nearly the same."""
    runs = {d: Run(d, streams, input_len, output_len) for d in dtypes}
    while any(r.engine.has_unfinished() for r in runs.values()):
        for r in runs.values():
            if r.engine.has_unfinished():
                r.step()
    results = {d: r.result() for d, r in runs.items()}
    del runs
    gc.collect()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=2000)
    ap.add_argument("--output-len", type=int, default=64)  # streams prefill one a step: 32 decode steps follow the last
    ap.add_argument("--dtypes", default="float16,int8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--paired", action="store_true", help="step one engine per type in turn (for a loaded machine)")
    ap.add_argument("--out", default=str(RESULTS / "kv_dtype_throughput"), help="path without suffix: .md and .json")
    a = ap.parse_args()
    dtypes = a.dtypes.split(",")
    runs: dict[str, list[dict]] = {d: [] for d in dtypes}
    loads = [os.getloadavg()[0]]
    for _ in range(a.rounds):
        if a.paired:
            for d, r in paired_runs(dtypes, a.streams, a.input_len, a.output_len).items():
                runs[d].append(r)
            loads.append(os.getloadavg()[0])
            print(runs, f"load {loads[-1]:.1f}", file=sys.stderr, flush=True)
            continue
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
            "loadavg": loads, "paired": a.paired}
    Path(a.out + ".json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs,
                                                 "ratio_per_round": per_round,
                                                 "prefill_ratio_per_round": prefill_per_round}, indent=2))
    lines = [f"# Decode with {a.input_len}-token prompts at {a.streams} streams, by KV cache type",
             "", f"{meta['cpu']['name']}, {meta['cpu']['cores']} cores ({' '.join(meta['cpu']['flags'])}); load average "
             f"during the runs {min(loads):.1f}-{max(loads):.1f}; {a.rounds} rounds, types interleaved"
             f"{' step by step (--paired)' if a.paired else ''}; "
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
