"""Bytes of one decode step's SchedulerOutput as tensor parallelism pickles it to every worker rank.

32 requests decode together at several context lengths: the scheduler alone (no model) prefills them, then
runs decode steps, each fed one sampled token per request; each decode step's SchedulerOutput is pickled the
way MultiprocExecutor sends it down a worker's pipe (multiprocessing's ForkingPickler). Before issue 29 a step
carried every request's whole block table (and its scheduled tokens); after it, a running request carries only
the block ids and token ids the runner does not hold yet, so the size stops growing with the context.

    PYTHONPATH=<tree>/src python benchmarks/scheduler_output_size.py --label before   # on main's tree
    PYTHONPATH=src python benchmarks/scheduler_output_size.py --label after

Each run merges its label into benchmarks/results/scheduler_output_size.json (and rewrites the .md beside it).
Only the Scheduler, KVCacheManager, Request and SamplingParams APIs are used, so one script measures both trees.
"""

from __future__ import annotations

import argparse
import json
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import SimpleNamespace

from lmserve.cache.kv_cache_manager import KVCacheManager
from lmserve.config import SchedulerConfig
from lmserve.request import Request, TokenLogprobs
from lmserve.sampling_params import SamplingParams
from lmserve.sched.scheduler import Scheduler

RESULTS = Path(__file__).resolve().parent / "results" / "scheduler_output_size.json"
BLOCK_SIZE = 16


def step_result(out, token: int) -> SimpleNamespace:
    """What update() reads from the runner: one sampled token for every request that samples this step."""
    ids = [[token] if r.sample else [] for r in out.requests]
    return SimpleNamespace(sampled_token_ids=ids, logprobs=[[TokenLogprobs(t, -1.0, []) for t in row] for row in ids],
                           prompt_logprobs={})


def decode_step_bytes(num_requests: int, context: int, steps: int) -> list[int]:
    """Pickled sizes of `steps` decode steps of `num_requests` requests whose prompts are `context` tokens."""
    blocks = num_requests * (-(-(context + steps + 1) // BLOCK_SIZE) + 1)
    kv = KVCacheManager(blocks, BLOCK_SIZE, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=num_requests * context),
                      kv)
    for i in range(num_requests):  # distinct prompts: no prefix sharing
        prompt = [(7 * i + j) % 30000 + 1 for j in range(context)]
        sched.add(Request(f"req-{i}", prompt, SamplingParams(temperature=0.0), steps + 2, frozenset()))
    out = sched.schedule()  # the prefill step: every request whole
    assert len(out.requests) == num_requests
    sched.update(out, step_result(out, 5))
    sizes = []
    for step in range(steps):
        out = sched.schedule()
        assert len(out.requests) == num_requests and all(r.num_tokens == 1 for r in out.requests)
        sizes.append(len(ForkingPickler.dumps(out)))
        sched.update(out, step_result(out, 6 + step))
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True, help="before | after (the tree PYTHONPATH points at)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--contexts", default="128,512,2048,8192")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        sizes = decode_step_bytes(args.requests, context, args.steps)
        rows.append({"context": context, "requests": args.requests, "bytes_per_step": sum(sizes) / len(sizes),
                     "bytes_per_request": sum(sizes) / len(sizes) / args.requests})
        print(f"{args.label}: context {context:5d}: {rows[-1]['bytes_per_step']:9.0f} B per decode step "
              f"({rows[-1]['bytes_per_request']:.0f} B per request)")
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data[args.label] = rows
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(report(data))


def report(data: dict) -> str:
    """A markdown table: one row per context length, one column per label."""
    labels = list(data)
    lines = ["# Pickled SchedulerOutput per decode step (32 running requests, block size 16)", "",
             "`python benchmarks/scheduler_output_size.py --label <before|after>`: what MultiprocExecutor sends each",
             "worker rank per step (ForkingPickler bytes, mean over 8 decode steps).", "",
             "| context | " + " | ".join(f"{label} (B/step)" for label in labels) + " |",
             "|---|" + "---|" * len(labels)]
    contexts = [r["context"] for r in data[labels[0]]]
    for c in contexts:
        cells = [next((f"{r['bytes_per_step']:.0f}" for r in data[label] if r["context"] == c), "-") for label in labels]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
