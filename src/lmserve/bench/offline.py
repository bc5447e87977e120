"""`lmserve bench latency | throughput | startup`: the engine measured directly, as % of the roofline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from lmserve.bench.roofline import Roofline, flops_per_token, measure
from lmserve.sampling_params import SamplingParams


def _prompt(n: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of exactly n token ids (ordinary vocabulary range)."""
    return [100 + (seed * 7919 + i * 104729) % 30000 for i in range(n)]


def _run_one(engine, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, time from first to last token, tokens) for one request alone."""
    engine.add_request("bench", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    start, first, n = time.perf_counter(), None, 0
    while engine.has_unfinished():
        for d in engine.step():
            n += len(d.token_ids)
            if first is None and d.token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    return first - start, end - first, n


def latency(engine, roof: Roofline, repeats: int = 3) -> dict:
    """Prefill tok/s at prompts of 128 and 512 tokens; decode tok/s at batch 1 from contexts ~0 and 512."""
    _run_one(engine, _prompt(32), 4)  # warm-up
    out: dict = {"prefill": {}, "decode": {}}
    for n in (128, 512):
        ttft = min(_run_one(engine, _prompt(n, r), 1)[0] for r in range(repeats))
        tps = n / ttft
        ceiling = roof.prefill_tok_s_ceiling
        out["prefill"][n] = {"ttft_ms": ttft * 1e3, "tok_s": tps, "pct_of_ceiling": 100 * tps / ceiling}
    for ctx in (1, 512):
        runs = [_run_one(engine, _prompt(ctx, r + 10), 65) for r in range(repeats)]
        tps = max((n - 1) / dec for _, dec, n in runs)
        out["decode"][ctx] = {"tok_s": tps, "ms_per_token": 1e3 / tps,
                              "pct_of_ceiling": 100 * tps / roof.decode_tok_s_ceiling}
    return out


def throughput(llm, roof: Roofline, num_prompts: int, input_len: int, output_len: int) -> dict:
    """Offline tokens/s for num_prompts prompts through the batching engine."""
    llm.generate([_prompt(8, 99)], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    prompts = [_prompt(input_len, i) for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    out_tps = num_prompts * output_len / seconds
    total_tps = num_prompts * (input_len + output_len) / seconds
    cfg = llm.engine.model_config
    # All tokens' matmul FLOPs against what the machine can compute (batched work is compute-bound).
    flops = num_prompts * (input_len + output_len) * flops_per_token(cfg)
    compute = roof.matmul_tflops.get(str(llm.engine.dtype).removeprefix("torch."), 0.0)
    return {"seconds": seconds, "output_tok_s": out_tps, "total_tok_s": total_tps,
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
    return measure(engine.loaded.model, engine.model_config, engine.dtype)
