"""Tensor or pipeline parallelism on this CPU: decode tokens/s with one rank vs two on one random-weight Llama.

    python benchmarks/tp.py [--tokens 64] [--batch 8] [--repeats 3] [--output benchmarks/results/tp]
    python benchmarks/tp.py --pipeline --batch 16 --output benchmarks/results/pp   # PP=2, micro-batches off vs on
    python benchmarks/tp.py --quick      # to check the script: 16 tokens, 1 repeat

With --pipeline the rows are one rank, PP=2 with each step whole (--pipeline-micro-batches 1) and PP=2 with each
step cut into two micro-batches (2, the default), so rank 0 runs one half of the batch while rank 1 runs the other;
a third column, prefill, is the prompt tokens/s of B fresh 64-token prompts arriving together.

The model is a random Llama written once into benchmarks/.cache/tp-llama (hidden 512, 8 layers, 8 heads and 4 KV
heads of 64, MLP 1536, vocab 8192: ~34M parameters, 134 MB in float32; the embedded SmolLM2 has 9 heads, which 2
does not divide). Each TP size gets a fresh engine (`LLM(tensor_parallel_size=N)`, float32) with the machine's
cores shared out between its ranks (2 cores, TP=2: one thread per rank), then, after one warm-up:
  batch 1   one greedy request, `--tokens` tokens (EOS ignored): output tokens / wall seconds of generate()
  batch B   B distinct greedy prompts, `--tokens` tokens each: all output tokens / wall seconds
Medians over `--repeats` (min-max beside them). The greedy tokens of every two-rank row must equal one rank's (the
run fails if not).
Every result records the CPU (model name, SIMD flags, cores) and how busy the machine was (load average before
and after, and the cores all processes kept busy during the run, this one and its ranks included): on a shared
machine the numbers move with the neighbours. Writes <output>.json and <output>.md.

On a CPU, TP=2 is not expected to be faster: both ranks share one memory bus that decode already saturates, and
each layer adds two all-reduces through gloo (loopback TCP) plus pickling the step to the other rank. What the
run shows is that the split is correct and what those seams cost.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from compare import _cpu_name, _flags  # noqa: E402  (benchmarks/compare.py: the same machine description)

MODEL_DIR = ROOT / "benchmarks" / ".cache" / "tp-llama"
VOCAB = 8192


def write_model(path: Path) -> None:
    """The random Llama (seeded) with a word-level tokenizer, written once."""
    if (path / "config.json").exists():
        return
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(path, safe_serialization=True)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def busy_cores() -> tuple[float, float]:
    """(monotonic seconds, CPU seconds busy on the whole machine so far), from /proc/stat."""
    ticks = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return time.monotonic(), (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


# row name -> LLM's parallel arguments
TP_ROWS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}}
PP_ROWS = {"pp1": {}, "pp2 micro-batches 1": {"pipeline_parallel_size": 2, "pipeline_micro_batches": 1},
           "pp2 micro-batches 2": {"pipeline_parallel_size": 2, "pipeline_micro_batches": 2}}


def measure(parallel: dict, args: argparse.Namespace) -> dict:
    """Load an engine with these parallel sizes, warm it up, time batch 1 and batch B decoding."""
    from lmserve import LLM, SamplingParams

    llm = LLM(str(MODEL_DIR), dtype="float32", num_blocks=256, **parallel)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    prompts = [[3 + (17 * i + j) % (VOCAB - 3) for j in range(16)] for i in range(args.batch)]
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        runs: dict[str, list[float]] = {"batch1": [], f"batch{args.batch}": []}
        tokens = None
        for r in range(args.repeats):
            start = time.perf_counter()
            one = llm.generate([prompts[0][:8] + [100 + r]], params, use_tqdm=False)  # no prefix-cache reuse
            runs["batch1"].append(args.tokens / (time.perf_counter() - start))
            start = time.perf_counter()
            outs = llm.generate([p + [200 + r] for p in prompts], params, use_tqdm=False)
            runs[f"batch{args.batch}"].append(args.tokens * len(prompts) / (time.perf_counter() - start))
            tokens = [o.outputs[0].token_ids for o in one + outs]
            if args.pipeline:
                runs.setdefault("prefill", []).append(prefill_rate(llm, args.batch, r))
    finally:
        llm.close()
    return {"tok_s": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in runs.items()},
            "tokens": tokens}


def prefill_rate(llm, batch: int, r: int) -> float:
    """Prompt tokens/s of `batch` fresh 64-token prompts arriving together (one output token each): a step of many
    prefill chunks, where the work per weight read is large."""
    from lmserve import SamplingParams

    prompts = [[3 + (31 * i + 7 * j + 1000 * r) % (VOCAB - 3) for j in range(64)] for i in range(batch)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return 64 * batch / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="16 tokens, 1 repeat: checks the script")
    p.add_argument("--pipeline", action="store_true", help="PP=2 with micro-batches off and on instead of TP=2")
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "tp"))
    args = p.parse_args()
    if args.quick:
        args.tokens, args.repeats = 16, 1
    write_model(MODEL_DIR)
    load_before, (t0, busy0) = os.getloadavg()[0], busy_cores()
    rows = PP_ROWS if args.pipeline else TP_ROWS
    results = {name: measure(parallel, args) for name, parallel in rows.items()}
    t1, busy1 = busy_cores()
    tokens = [r.pop("tokens") for r in results.values()]
    same = all(t == tokens[0] for t in tokens[1:])
    report = {
        "machine": f"{_cpu_name()} ({platform.machine()}; {_flags()})", "cores": len(os.sched_getaffinity(0)),
        "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
        "machine_busy_cores_during_run": (busy1 - busy0) / (t1 - t0),
        "model": "random Llama: hidden 512, 8 layers, 8 heads / 4 KV heads of 64, MLP 1536, vocab 8192, float32",
        "kind": "pipeline" if args.pipeline else "tensor", "command": " ".join(["python", *sys.argv]),
        "tokens": args.tokens, "batch": args.batch, "repeats": args.repeats,
        "greedy_tokens_equal": same, "results": {name: r["tok_s"] for name, r in results.items()},
    }
    out = Path(args.output)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    if not same:
        sys.exit("two ranks' greedy tokens differ from one rank's")


def markdown(r: dict) -> str:
    """The report as a table with its machine and load notes."""
    rows = [f"| {name} | " + " | ".join(f"{v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f})"
                                         for v in res.values()) + " |" for name, res in r["results"].items()]
    head = "| | " + " | ".join(f"{k} tok/s" for k in next(iter(r["results"].values()))) + " |"
    title = ("Pipeline parallelism: one rank vs PP=2, micro-batches off and on" if r.get("kind") == "pipeline"
             else "Tensor parallelism: TP=1 vs TP=2")
    return "\n".join([
        f"# {title} ({r['tokens']} tokens per request, median of {r['repeats']})", "",
        *([f"Command: `{r['command']}`", ""] if "command" in r else []),
        f"Machine: {r['machine']}, {r['cores']} cores. Model: {r['model']}.",
        f"Load average (1 min) {r['loadavg_1m_before']:.1f} before, {r['loadavg_1m_after']:.1f} after; all processes "
        f"kept {r['machine_busy_cores_during_run']:.2f} of {r['cores']} cores busy during the run (this run included): "
        "the machine was shared, so the numbers carry the neighbours' load.", "",
        head, "| --- |" + " --- |" * (len(rows[0].split("|")) - 3), *rows, "",
        f"Greedy tokens of two ranks == one rank's: {r['greedy_tokens_equal']}.", ""])


if __name__ == "__main__":
    main()
