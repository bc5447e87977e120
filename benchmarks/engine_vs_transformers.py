"""Offline throughput and single-stream decode: lmserve's engine vs Hugging Face transformers, one run.

    python benchmarks/engine_vs_transformers.py [--prompts 64] [--output-len 128] [--quantization int4]
        [--out benchmarks/results/engine_vs_transformers.json]

Both sides load the embedded SmolLM2 GGUF in the same dtype (float32 by default: this CPU has no
native bf16, where bf16 matmuls run ~100x slower), use the same prompts, generate exactly
`--output-len` tokens greedily (EOS ignored), and run on the same threads. Runs alternate
(ours, theirs, ours, theirs) after a warm-up; the median of the repeats is reported with min-max.
The report ends with this CPU's fp32 ceiling for the offline run (FLOPs of the work over the best
measured fp32 matmul rate): no fp32 engine can beat transformers by more than that ratio here.
Both live in this one process, which imports torch before lmserve: libgomp's default (spinning waiters), which
transformers' users run under, for both sides; lmserve's own commands run with OMP_WAIT_POLICY=PASSIVE, so its rows
here are conservative (the engine warns so at start).
`--quantization int4` (the default; "none" skips it) adds lmserve on weight-only quantized weights in
the same run: for this Q4_1 file that is the file's own 4-bit codes, with bfloat16 activations inside
the matmuls, so its numbers are not the same numerics as the float32 rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

WORDS = ("lmserve serves language models over HTTP with paged attention continuous batching and "
         "careful numerics so every request sees the same tokens it would alone ").split()


def make_prompts(n: int, tokenizer, length: int, first: int = 0) -> list[list[int]]:
    """n distinct prompts of exactly `length` tokens each (equal lengths keep transformers' static batch honest).

    Each starts with its own number (first, first + 1, ...), so no two share a first KV block: prefix
    caching cannot skip any prefill work that transformers has to do. Every repeat takes new numbers.
    """
    out = []
    for i in range(first, first + n):
        text = f"Note {i}: " + " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(length * 2))
        out.append(tokenizer.encode(text)[:length])
    assert len({tuple(p[:16]) for p in out}) == n, "prompts must differ within their first block"
    return out


def ours_throughput(llm, prompts, output_len: int) -> float:
    from lmserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return len(prompts) * output_len / seconds


def ours_single(llm, prompt, output_len: int) -> float:
    """Decode tokens/s of one stream, prefill excluded (time from first to last token)."""
    from lmserve import SamplingParams

    eng = llm.engine
    eng.add_request("single", prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    first = None
    n = 0
    while eng.has_unfinished():
        for d in eng.step():
            n += len(d.token_ids)
            if first is None:
                first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - first)


def hf_throughput(model, prompts, output_len: int, batch: int) -> float:
    """Static batches of `batch` prompts through `generate` (transformers has no continuous batching)."""
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i:i + batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + output_len
    return len(prompts) * output_len / (time.perf_counter() - start)


def hf_single(model, prompt, output_len: int) -> float:
    """Decode tokens/s at batch 1, prefill excluded (generate 1 token vs output_len tokens)."""
    ids = torch.tensor([prompt])
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
        t2 = time.perf_counter()
    return (output_len - 1) / ((t2 - t1) - (t1 - t0))


def offline_ceiling(cfg, prompts: int, prompt_len: int, output_len: int) -> dict:
    """The most output tok/s any fp32 engine can reach on this CPU for the offline run.

    Work: every prompt and output token through the decoder's matmuls, the LM head once per output
    token (attention left out, so this bounds from above); speed: the best fp32 matmul rate measured
    at the model's own MLP shapes (lmserve bench roofline's figure).
    """
    from lmserve.bench.roofline import flops_per_token, matmul_tflops

    head = 2.0 * cfg.hidden_size * cfg.vocab_size
    decoder = flops_per_token(cfg) - head
    work = prompts * ((prompt_len + output_len) * decoder + output_len * head)
    tflops = max(matmul_tflops(cfg, torch.float32) for _ in range(3))
    return {"fp32_matmul_tflops": tflops, "workload_tflop": work / 1e12,
            "max_output_tok_s": prompts * output_len / (work / (tflops * 1e12))}


def summarize(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="int4", choices=["none", "int8", "int4"])
    ap.add_argument("--out", default="benchmarks/results/engine_vs_transformers.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    from transformers import AutoModelForCausalLM

    from lmserve import LLM
    from lmserve.loader import default_model_path

    path = default_model_path()
    llm = LLM(dtype=args.dtype, quantization="none", max_num_seqs=args.prompts, max_num_batched_tokens=2048)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    prompts = make_prompts(args.prompts, llm.tokenizer, args.prompt_len, first=10_000)  # for the warm-ups
    quant = None if args.quantization == "none" else LLM(dtype=args.dtype, max_num_seqs=args.prompts,
                                                          max_num_batched_tokens=2048, quantization=args.quantization)

    # warm-up (discarded): allocator, thread pools, code paths
    ours_throughput(llm, prompts[:4], 8)
    hf_throughput(hf, prompts[:4], 8, 4)
    res = {"ours_tput": [], "hf_tput": [], "ours_single": [], "hf_single": []}
    if quant is not None:
        ours_throughput(quant, prompts[:4], 8)
        res.update(quant_tput=[], quant_single=[])
    ceilings = [offline_ceiling(llm.engine.model_config, args.prompts, args.prompt_len, args.output_len)]
    for r in range(args.repeats):
        prompts = make_prompts(args.prompts, llm.tokenizer, args.prompt_len, first=r * args.prompts)
        res["ours_tput"].append(ours_throughput(llm, prompts, args.output_len))
        res["hf_tput"].append(hf_throughput(hf, prompts, args.output_len, args.hf_batch))
        if quant is not None:
            res["quant_tput"].append(ours_throughput(quant, prompts, args.output_len))
        res["ours_single"].append(ours_single(llm, prompts[0], args.output_len))
        res["hf_single"].append(hf_single(hf, prompts[0], args.output_len))
        if quant is not None:
            res["quant_single"].append(ours_single(quant, prompts[0], args.output_len))
    report = {k: summarize(v) for k, v in res.items()}
    from compare import _cpu_name, _flags  # benchmarks/compare.py: the same machine description

    report["config"] = {**vars(args), "machine": f"{_cpu_name()} ({platform.machine()}; {_flags()})",
                        "torch": torch.__version__, "cpu_count": torch.get_num_threads()}
    t_ratio = report["ours_tput"]["median"] / report["hf_tput"]["median"]
    s_ratio = report["ours_single"]["median"] / report["hf_single"]["median"]
    report["ratios"] = {"throughput": t_ratio, "single_stream": s_ratio}
    # this CPU's speed drifts over minutes: the faster of two measurements (start, end) is the ceiling
    ceilings.append(offline_ceiling(llm.engine.model_config, args.prompts, args.prompt_len, args.output_len))
    ceiling = max(ceilings, key=lambda c: c["fp32_matmul_tflops"])
    ceiling["max_ratio_to_transformers"] = ceiling["max_output_tok_s"] / report["hf_tput"]["median"]
    ceiling["lmserve_fraction_of_ceiling"] = report["ours_tput"]["median"] / ceiling["max_output_tok_s"]
    report["fp32_offline_ceiling"] = ceiling
    print(f"{'':28}{'lmserve':>12}{'transformers':>14}{'ratio':>8}")
    print(f"{'offline tok/s (%d x %d)' % (args.prompts, args.output_len):28}"
          f"{report['ours_tput']['median']:>12.1f}{report['hf_tput']['median']:>14.1f}{t_ratio:>8.2f}")
    print(f"{'single-stream decode tok/s':28}{report['ours_single']['median']:>12.1f}"
          f"{report['hf_single']['median']:>14.1f}{s_ratio:>8.2f}")
    if quant is not None:
        qt = report["quant_tput"]["median"] / report["hf_tput"]["median"]
        qs = report["quant_single"]["median"] / report["hf_single"]["median"]
        report["ratios"].update({f"{args.quantization}_throughput": qt, f"{args.quantization}_single_stream": qs})
        print(f"{'offline, lmserve ' + args.quantization:28}{report['quant_tput']['median']:>12.1f}"
              f"{report['hf_tput']['median']:>14.1f}{qt:>8.2f}")
        print(f"{'single-stream, lmserve ' + args.quantization:28}{report['quant_single']['median']:>12.1f}"
              f"{report['hf_single']['median']:>14.1f}{qs:>8.2f}")
    print(f"fp32 ceiling on this CPU ({ceiling['fp32_matmul_tflops'] * 1e3:.0f} GFLOP/s at the model's shapes): "
          f"{ceiling['max_output_tok_s']:.1f} tok/s offline = {ceiling['max_ratio_to_transformers']:.2f}x "
          f"transformers; lmserve float32 reaches {ceiling['lmserve_fraction_of_ceiling']:.0%} of it")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
