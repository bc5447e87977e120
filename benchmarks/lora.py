"""Multi-LoRA on the embedded SmolLM2 GGUF (float32, CPU): a mixed-adapter batch against the base alone, one run.

    python benchmarks/lora.py                      # full run (a few minutes on 2 cores)
    python benchmarks/lora.py --quick              # tiny sizes, to check the script

Measured in one process, in alternating repeats (base, lora, lora_base; then turned by one), because the machine is
shared and only a ratio taken in the same run means anything:
  base        an engine without --enable-lora: 32 greedy requests (distinct random prompts, new each repeat,
              so that no run reuses an earlier run's KV blocks; EOS ignored)
  lora        an engine with 8 rank-16 adapters on all 7 projections (--max-loras 8): the same 32 requests,
              request i on adapter i % 8, all in one batch (issue 46: >= 0.8x base tokens/s)
  lora_base   the LoRA engine running the 32 requests on the base model (the cost of the wrappers alone)
  lora_f32    (beside, labelled) a LoRA engine with --lora-dtype float32: the same 32 adapter requests with float32
              slots, what every LoRA row measured before --lora-dtype auto chose float16 over the GGUF blocks
Throughput is generated tokens / wall time from adding the batch to its last token (prefill included).
Adapter load time: `read_peft_adapter` of a rank-16 all-projection adapter (PEFT safetensors written by this
script with PEFT's tensor names), p50 over every adapter x --load-repeats (the files sit in the page cache after
the first read: this is the parse + check + float32 copy, not the disk). Slot write: copying one adapter into a
device slot (what the engine thread does when an adapter gets a slot), p50. Memory per adapter: host bytes
(PeftAdapter.nbytes) and device-slot bytes at --max-lora-rank 16. Results: benchmarks/results/lora.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import lmserve  # noqa: F401  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

# isort: split
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from compare import _cpu_name, _flags  # noqa: E402  the same machine description as the other benchmarks

from lmserve.config import CacheConfig, EngineConfig, LoraConfig  # noqa: E402
from lmserve.engine.llm_engine import LLMEngine  # noqa: E402
from lmserve.loader import default_model_path, read_model_config  # noqa: E402
from lmserve.lora.peft_adapter import read_peft_adapter  # noqa: E402
from lmserve.sampling_params import SamplingParams  # noqa: E402

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) with random A and B."""
    out.mkdir(parents=True, exist_ok=True)
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (cfg.q_size, h), "k_proj": (cfg.kv_size, h), "v_proj": (cfg.kv_size, h),
              "o_proj": (h, cfg.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj, (n_out, n_in) in shapes.items():
            block = "self_attn" if proj in PROJ[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJ), "bias": "none",
        "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}))
    return out


def run_batch(engine: LLMEngine, prompts: list[list[int]], loras: list, output_len: int) -> tuple[float, float]:
    """Generated tokens per wall second and per CPU second of this process, for the whole batch added at once.

    CPU seconds (time.process_time) count only this process's own work, so they move less than wall time
    when other jobs take the shared cores (idle OpenMP threads sleep: they add no CPU time while waiting).
    """
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{i}-{start}", p, params, lora=lora)
    n = 0
    while engine.has_unfinished():
        n += sum(len(d.token_ids) for d in engine.step())
    return n / (time.perf_counter() - start), n / (time.process_time() - cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--load-repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lora-dtype", default="auto", help="the LoRA engine's slots (default: auto, as a user runs it)")
    ap.add_argument("--quick", action="store_true", help="4 requests, 2 adapters, 8 tokens, 1 repeat")
    ap.add_argument("--out", default=str(ROOT / "results" / "lora.json"))
    args = ap.parse_args()
    if args.quick:
        args.requests, args.adapters, args.output_len, args.repeats, args.load_repeats = 4, 2, 8, 1, 1
        args.out = str(ROOT / ".cache" / "lora_quick.json")
    model = default_model_path()
    cfg = read_model_config(model)
    cache_dir = ROOT / ".cache" / "lora_adapters"
    paths = [write_adapter(cache_dir / f"r{args.rank}_{i}", cfg, args.rank, seed=i) for i in range(args.adapters)]

    load_s = [_timed(lambda p=p: read_peft_adapter(p, cfg, name="x", max_rank=args.rank))
              for _ in range(args.load_repeats) for p in paths]
    host_bytes = read_peft_adapter(paths[0], cfg, name="x", max_rank=args.rank).nbytes

    common = dict(model=str(model), num_threads=args.threads, cache=CacheConfig(num_blocks=1024),
                  )
    base_engine = LLMEngine(EngineConfig(**common))
    lora_cfg = LoraConfig(tuple((f"a{i}", str(p)) for i, p in enumerate(paths)), max_loras=args.adapters,
                          max_cpu_loras=args.adapters, max_lora_rank=args.rank, dtype=args.lora_dtype)
    lora_engine = LLMEngine(EngineConfig(**common, lora=lora_cfg), tokenizer=base_engine.tokenizer)
    loras = [lora_engine.loras.get(f"a{i % args.adapters}") for i in range(args.requests)]
    f32_engine = LLMEngine(EngineConfig(**common, lora=replace(lora_cfg, dtype="float32")),
                           tokenizer=base_engine.tokenizer)
    f32_loras = [f32_engine.loras.get(f"a{i % args.adapters}") for i in range(args.requests)]
    slot_s = [_timed(lambda lr=lr, s=s: lora_engine.lora_slots._write(s, lr)) for s, lr in
              enumerate(loras[:args.adapters])]

    g = torch.Generator().manual_seed(0)

    def fresh_prompts() -> list[list[int]]:
        return [torch.randint(100, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
                for _ in range(args.requests)]

    none = [None] * args.requests
    warm = fresh_prompts()
    run_batch(base_engine, warm[:2], none[:2], 4)  # warm-up: kernels, allocator
    run_batch(lora_engine, warm[:2], loras[:2], 4)
    run_batch(f32_engine, warm[:2], f32_loras[:2], 4)
    results = {"base": [], "lora": [], "lora_base": [], "lora_f32": []}
    cpu_results = {"base": [], "lora": [], "lora_base": [], "lora_f32": []}
    runs = [("base", base_engine, none), ("lora", lora_engine, loras), ("lora_base", lora_engine, none),
            ("lora_f32", f32_engine, f32_loras)]
    for rep in range(args.repeats):
        # New prompts every repeat: with the same 32 each time, a run could find its prompts' KV blocks still in
        # the prefix cache from an earlier repeat, or not (eviction), and on Zen 1 that alone moved a run between
        # ~115 and ~190 tok/s (2,048 prompt tokens: 6-7 s computed, ~1.7 s mostly cached). The three rows of a
        # repeat share them and still compute every prompt: two engines, and adapter rows' blocks are salted by
        # their adapter, so the base rows on the LoRA engine never hit the LoRA rows' blocks.
        prompts = fresh_prompts()
        # the order turns each repeat, so that no row always follows the same one
        for key, engine, which in runs[rep % len(runs):] + runs[:rep % len(runs)]:
            wall, cpu = run_batch(engine, prompts, which, args.output_len)
            results[key].append(wall)
            cpu_results[key].append(cpu)
    med = {k: statistics.median(v) for k, v in results.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_results.items()}
    # each repeat's lora / base, taken back to back: the load of the shared machine changes between repeats
    paired = [lo / b for lo, b in zip(results["lora"], results["base"])]
    report = {
        "cpu": _cpu_name(), "cpu_flags": _flags(), "cores": os.cpu_count(), "threads": args.threads,
        "python": platform.python_version(), "torch": torch.__version__, "model": model.name,
        "command": "python benchmarks/lora.py" + (" --quick" if args.quick else "")
                   + (f" --lora-dtype {args.lora_dtype}" if args.lora_dtype != "auto" else ""),
        "slot_dtype": str(lora_engine.lora_slots.lora_dtype).removeprefix("torch."), "lora_dtype": args.lora_dtype,
        "sizes": {k: getattr(args, k) for k in ("requests", "adapters", "rank", "prompt_len", "output_len",
                                                "repeats", "load_repeats")},
        "tokens_per_s": results, "median_tokens_per_s": med,
        "tokens_per_cpu_s": cpu_results, "median_tokens_per_cpu_s": cpu_med,
        "lora_vs_base_cpu": cpu_med["lora"] / cpu_med["base"],
        "lora_vs_base": med["lora"] / med["base"], "lora_engine_base_vs_base": med["lora_base"] / med["base"],
        "lora_f32_vs_base": med["lora_f32"] / med["base"],
        "lora_f32_vs_base_per_repeat": [lo / b for lo, b in zip(results["lora_f32"], results["base"])],
        "device_bytes_per_slot_f32": f32_engine.lora_slots.bytes_per_slot,
        "lora_vs_base_per_repeat": paired, "lora_vs_base_paired_median": statistics.median(paired),
        "adapter_load_p50_s": statistics.median(load_s), "adapter_load_all_s": load_s,
        "slot_write_p50_s": statistics.median(slot_s),
        "host_bytes_per_adapter": host_bytes, "device_bytes_per_slot": lora_engine.lora_slots.bytes_per_slot,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(report))
    print(_markdown(report))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _markdown(r: dict) -> str:
    s, m = r["sizes"], r["median_tokens_per_s"]
    rng = lambda k: f"{min(r['tokens_per_s'][k]):.1f}-{max(r['tokens_per_s'][k]):.1f}"  # noqa: E731
    return f"""# Multi-LoRA: mixed-adapter batch vs the base model (one run)

`{r['command']}` on {r['cpu']} ({r['cores']} cores, shared with other jobs; {r['threads']} threads;
flags {r['cpu_flags']}), torch {r['torch']}, {r['model']} in float32. The machine was shared during the
run, so only the ratios taken in this same run (alternating repeats) count, not the absolute numbers.

{s['requests']} greedy requests, {s['prompt_len']}-token random prompts (new each repeat), {s['output_len']} tokens each (EOS ignored),
one batch; median of {s['repeats']} repeats (min-max):

| engine | requests on | tokens/s | vs base |
| --- | --- | --- | --- |
| no LoRA | base | {m['base']:.1f} ({rng('base')}) | 1.00x |
| --enable-lora, {s['adapters']} slots ({r['slot_dtype']}: --lora-dtype {r.get('lora_dtype', 'auto')}) | {s['adapters']} distinct rank-{s['rank']} adapters (all 7 projections) | {m['lora']:.1f} ({rng('lora')}) | **{r['lora_vs_base']:.2f}x** |
| --enable-lora, {s['adapters']} slots | base | {m['lora_base']:.1f} ({rng('lora_base')}) | {r['lora_engine_base_vs_base']:.2f}x |
| beside, labelled: --enable-lora --lora-dtype float32 | the same adapter requests | {m['lora_f32']:.1f} ({rng('lora_f32')}) | {r['lora_f32_vs_base']:.2f}x |

Per repeat, LoRA batch / base batch run back to back: {', '.join(f'{x:.2f}' for x in r['lora_vs_base_per_repeat'])}
(median **{r['lora_vs_base_paired_median']:.2f}x**; issue 46: >= 0.8x). With float32 slots, per repeat:
{', '.join(f'{x:.2f}' for x in r['lora_f32_vs_base_per_repeat'])}.

Tokens per CPU second of the benchmark process (less sensitive to the other jobs than wall time), medians:
base {r['median_tokens_per_cpu_s']['base']:.1f}, LoRA batch {r['median_tokens_per_cpu_s']['lora']:.1f}
(**{r['lora_vs_base_cpu']:.2f}x**), base requests on the LoRA engine {r['median_tokens_per_cpu_s']['lora_base']:.1f}.

Adapter (rank {s['rank']}, all 7 projections, 30 layers): read + check from disk p50
**{r['adapter_load_p50_s'] * 1000:.0f} ms** (page-cached files, {len(r['adapter_load_all_s'])} reads); writing it into a
device slot p50 {r['slot_write_p50_s'] * 1000:.1f} ms. Added memory per adapter: host copy
**{r['host_bytes_per_adapter'] / 2**20:.1f} MiB** (float32), device slot **{r['device_bytes_per_slot'] / 2**20:.1f} MiB**
({r['slot_dtype']}; {r['device_bytes_per_slot_f32'] / 2**20:.1f} MiB in float32) at --max-lora-rank {s['rank']} (slots are
sized for the largest rank: 4x that at the default 64).
"""


if __name__ == "__main__":
    main()
