"""Embedding throughput against a plain prefill of the same tokens, on the embedded SmolLM2 GGUF (CPU), one engine.

    python benchmarks/embeddings.py            # full run (about a minute on 2 quiet cores)
    python benchmarks/embeddings.py --quick    # tiny sizes, to check the script

Both sides run the same --requests prompts of --prompt-len random tokens through one LLMEngine (prefix caching
off, so every repeat computes every token), in alternating repeats (prefill, embed, prefill, embed, ...), because
the machine is shared and only a ratio taken back to back means anything:
  prefill   generation requests with max_tokens 1: the prompt, the LM head on its last row, one greedy sample
  embed     pooling requests (the model's pooling: last-token here): the prompt, then the pooled, normalised
            vector; no LM head, no sampling (target: >= 0.8x prefill's prompt tokens/s)
Throughput is prompt tokens / wall time from adding the batch to its last request finishing. The load average
of the machine is recorded before and after. Results: benchmarks/results/embeddings.{json,md}.
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

import lmserve  # noqa: F401  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

# isort: split
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from compare import _cpu_name, _flags  # noqa: E402  the same machine description as the other benchmarks

from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from lmserve.engine.llm_engine import LLMEngine  # noqa: E402
from lmserve.loader import default_model_path  # noqa: E402
from lmserve.pooling_params import PoolingParams  # noqa: E402
from lmserve.sampling_params import SamplingParams  # noqa: E402

PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
EMBED = SamplingParams(max_tokens=1, pooling=PoolingParams())


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> float:
    """Seconds from adding every prompt to the last one finishing."""
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="4 requests of 16 tokens, 1 repeat")
    ap.add_argument("--out", default=str(ROOT / "results" / "embeddings.json"))
    args = ap.parse_args()
    if args.quick:
        args.requests, args.prompt_len, args.repeats = 4, 16, 1
        args.out = str(ROOT / ".cache" / "embeddings_quick.json")
    model = default_model_path()
    engine = LLMEngine(EngineConfig(model=str(model), num_threads=args.threads,
                                    cache=CacheConfig(num_blocks=1024, enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=1024)))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, engine.model_config.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.requests)]
    load_before = os.getloadavg()
    run_batch(engine, prompts[:2], PREFILL, "warm-p")  # warm-up: kernels, allocator
    run_batch(engine, prompts[:2], EMBED, "warm-e")
    seconds: dict[str, list[float]] = {"prefill": [], "embed": []}
    for r in range(args.repeats):
        seconds["prefill"].append(run_batch(engine, prompts, PREFILL, f"p{r}"))
        seconds["embed"].append(run_batch(engine, prompts, EMBED, f"e{r}"))
    load_after = os.getloadavg()
    tokens = args.requests * args.prompt_len
    tps = {k: [tokens / s for s in v] for k, v in seconds.items()}
    paired = [e / p for e, p in zip(tps["embed"], tps["prefill"])]  # each repeat's ratio, taken back to back
    report = {
        "cpu": _cpu_name(), "cpu_flags": _flags(), "cores": os.cpu_count(), "threads": args.threads,
        "python": platform.python_version(), "torch": torch.__version__, "model": model.name,
        "pooling": engine.front.pooler.method,
        "command": " ".join(["python benchmarks/embeddings.py", *sys.argv[1:]]),
        "sizes": {"requests": args.requests, "prompt_len": args.prompt_len, "repeats": args.repeats},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "prompt_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in tps.items()},
        "median_prompt_tokens_per_s": {k: round(statistics.median(v), 1) for k, v in tps.items()},
        "embed_over_prefill_paired": [round(x, 3) for x in paired],
        "embed_over_prefill_median": round(statistics.median(paired), 3),
        "target": 0.8,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(report))
    print(json.dumps(report, indent=2))


def _markdown(r: dict) -> str:
    med = r["median_prompt_tokens_per_s"]
    return (f"# Embeddings vs a plain prefill of the same tokens\n\n"
            f"`{r['command']}` on {r['cpu']} ({r['cores']} cores, {r['threads']} threads), {r['model']}, "
            f"{r['pooling']}-token pooling; {r['sizes']['requests']} prompts of {r['sizes']['prompt_len']} random "
            f"tokens, {r['sizes']['repeats']} alternating repeats, prefix caching off.\n\n"
            f"**Load average** (1, 5, 15 min) before {r['load_average_before']}, after {r['load_average_after']}: "
            f"the machine was shared with other engineers' jobs, so absolute tokens/s are noisy; the paired ratio "
            f"(each repeat's embed over the prefill just before it) is the number to read.\n\n"
            f"| | prompt tokens/s (median) | per repeat |\n|---|---|---|\n"
            f"| prefill (max_tokens 1) | {med['prefill']} | {r['prompt_tokens_per_s']['prefill']} |\n"
            f"| embed | {med['embed']} | {r['prompt_tokens_per_s']['embed']} |\n\n"
            f"embed / prefill, paired: {r['embed_over_prefill_paired']}, median **{r['embed_over_prefill_median']}x** "
            f"(target >= {r['target']}x).\n")


if __name__ == "__main__":
    main()
