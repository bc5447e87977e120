"""`lmserve bench latency | throughput | startup`: the engine measured directly, as % of the roofline.

Every case starts with an untimed warm-up of its own shapes: the first run of a shape pays one-time costs
(oneDNN primitives for its row counts, allocator growth) that are no part of steady-state speed.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from lmserve.bench.roofline import Roofline, flops_per_token, measure
from lmserve.sampling_params import SamplingParams


@dataclass
class BatchTiming:
    """One batch run alone: time until every sequence had its first token, then each decode step."""

    ttft_s: float
    decode_steps_s: list[float]  # one entry per step after the last prefill: one token per sequence

    @property
    def tpot_s(self) -> float:
        return statistics.median(self.decode_steps_s) if self.decode_steps_s else float("nan")


def _prompt(n: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of exactly n token ids (ordinary vocabulary range); seeds differ in the
    first token, so no two seeds share a cached prefix block."""
    return [100 + (seed * 7919 + i * 104729) % 30000 for i in range(n)]


def run_batch(engine, prompts: list[list[int]], output_len: int, on_token=None) -> BatchTiming:
    """Run `prompts` together to `output_len` tokens each; `on_token(n)` is told of every n new tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for p in prompts:
        engine.add_request(f"bench-{next(_ids)}", p, params)
    started: set[str] = set()
    start = last = time.perf_counter()
    ttft, steps = None, []
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter()
        if ttft is None:
            started.update(d.request_id for d in deltas if d.token_ids)
            ttft = now - start if len(started) == len(prompts) else None
        else:
            steps.append(now - last)
        last = now
        if on_token:
            on_token(sum(len(d.token_ids) for d in deltas))
    return BatchTiming(ttft if ttft is not None else last - start, steps)


_ids = itertools.count()


def latency_case(engine, roof: Roofline, batch: int, input_len: int, output_len: int, iters: int,
                 bar=None) -> dict:
    """One batch size: a warm-up run (excluded: it pays the one-time costs of this batch's shapes), then
    `iters` timed runs of fresh prompts; TTFT is the best run's, TPOT the median decode step over all."""
    tick = bar.update if bar is not None else None
    seeds = itertools.count(batch * 100_000)
    warm = run_batch(engine, [_prompt(input_len, next(seeds)) for _ in range(batch)], output_len, tick)
    runs = [run_batch(engine, [_prompt(input_len, next(seeds)) for _ in range(batch)], output_len, tick)
            for _ in range(iters)]
    ttft = min(r.ttft_s for r in runs)
    tpot = statistics.median([s for r in runs for s in r.decode_steps_s] or [float("nan")])
    # Every weight byte is read once per step whatever the batch, up to the compute ceiling.
    ceiling = min(batch * roof.decode_tok_s_ceiling, roof.prefill_tok_s_ceiling)
    return {"batch_size": batch, "input_len": input_len, "output_len": output_len,
            "ttft_ms": 1e3 * ttft, "tpot_ms": 1e3 * tpot, "prefill_tok_s": batch * input_len / ttft,
            "decode_tok_s": batch / tpot, "decode_ceiling_tok_s": ceiling,
            "pct_of_decode_ceiling": 100 * batch / tpot / ceiling,
            "warmup_ttft_ms": 1e3 * warm.ttft_s, "warmup_tpot_ms": 1e3 * warm.tpot_s}


def throughput_case(engine, roof: Roofline, num_prompts: int, input_len: int, output_len: int, bar=None) -> dict:
    """Offline tokens/s for num_prompts prompts through the batching engine (at most its max_num_seqs
    at once), after an untimed warm-up at the same batch size with short prompts."""
    batch = engine.cfg.scheduler.max_num_seqs
    run_batch(engine, [_prompt(8, 900_000 + i) for i in range(min(batch, num_prompts))], 4)
    tick = bar.update if bar is not None else None
    start = time.perf_counter()
    run_batch(engine, [_prompt(input_len, 1_000_000 + i) for i in range(num_prompts)], output_len, tick)
    seconds = time.perf_counter() - start
    # All tokens' matmul FLOPs against what the machine can compute (batched work is compute-bound).
    flops = num_prompts * (input_len + output_len) * flops_per_token(engine.model_config)
    compute = roof.matmul_tflops.get(str(engine.dtype).removeprefix("torch."), 0.0)
    return {"batch_size": batch, "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
            "seconds": seconds, "output_tok_s": num_prompts * output_len / seconds,
            "total_tok_s": num_prompts * (input_len + output_len) / seconds,
            "achieved_tflops": flops / seconds / 1e12,
            "pct_of_compute_ceiling": 100 * flops / seconds / 1e12 / compute if compute else None}


STARTUP_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from lmserve.engine.llm_engine import LLMEngine
from lmserve.config import EngineConfig
from lmserve.sampling_params import SamplingParams
t1 = time.perf_counter()
eng = LLMEngine(EngineConfig(model=sys.argv[1] or None, num_threads=int(sys.argv[2])))
t2 = time.perf_counter()
eng.add_request("w", [100, 200, 300], SamplingParams(max_tokens=2, temperature=0.0))
while eng.has_unfinished(): eng.step()
t3 = time.perf_counter()
eng.add_request("f", [100, 200, 300, 400], SamplingParams(max_tokens=1, temperature=0.0))
while eng.has_unfinished(): eng.step()
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "weights_s": eng.loaded.load_seconds,
                  "warmup_s": t3 - t2, "first_token_s": t4 - t3}))
"""


def startup(model: str | None, threads: int) -> dict:
    """A fresh process: interpreter start, imports, weight load, warm-up, first token."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", STARTUP_PROBE, model or "", str(threads)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, check=True)
    total = time.perf_counter() - start
    phases = json.loads(proc.stdout.strip().splitlines()[-1])
    phases["process_to_first_token_s"] = total
    phases["interpreter_s"] = total - sum(v for k, v in phases.items() if k.endswith("_s") and k not in
                                          ("weights_s", "process_to_first_token_s"))
    return phases


def roofline_for(engine) -> Roofline:
    """The machine's measured ceilings for this engine's model and dtype."""
    return measure(engine.loaded.model, engine.model_config, engine.dtype)
