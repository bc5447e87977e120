"""Offline throughput and single-stream decode: lmserve's engine vs Hugging Face transformers, one run.

    python benchmarks/engine_vs_transformers.py [--prompts 64] [--output-len 128] [--quantization int4]
        [--out benchmarks/results/engine_vs_transformers.json]

Both sides load the embedded SmolLM2 GGUF in the same dtype (float32 by default: this CPU has no
native bf16, where bf16 matmuls run ~100x slower), use the same prompts, generate exactly
`--output-len` tokens greedily (EOS ignored), and run on the same threads. Runs alternate
(ours, theirs, ours, theirs) after a warm-up; the median of the repeats is reported with min-max.
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


def make_prompts(n: int, tokenizer, length: int) -> list[list[int]]:
    """n distinct prompts of exactly `length` tokens each (equal lengths keep transformers' static batch honest).

    Each starts with its own number, so no two share a first KV block: prefix caching cannot skip any
    prefill work that transformers has to do.
    """
    out = []
    for i in range(n):
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
    llm = LLM(dtype=args.dtype, max_num_seqs=args.prompts, max_num_batched_tokens=2048)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    prompts = make_prompts(args.prompts, llm.tokenizer, args.prompt_len)
    quant = None if args.quantization == "none" else LLM(dtype=args.dtype, max_num_seqs=args.prompts,
                                                          max_num_batched_tokens=2048, quantization=args.quantization)

    # warm-up (discarded): allocator, thread pools, code paths
    ours_throughput(llm, prompts[:4], 8)
    hf_throughput(hf, prompts[:4], 8, 4)
    res = {"ours_tput": [], "hf_tput": [], "ours_single": [], "hf_single": []}
    if quant is not None:
        ours_throughput(quant, prompts[:4], 8)
        res.update(quant_tput=[], quant_single=[])
    for _ in range(args.repeats):
        res["ours_tput"].append(ours_throughput(llm, prompts, args.output_len))
        res["hf_tput"].append(hf_throughput(hf, prompts, args.output_len, args.hf_batch))
        if quant is not None:
            res["quant_tput"].append(ours_throughput(quant, prompts, args.output_len))
        res["ours_single"].append(ours_single(llm, prompts[0], args.output_len))
        res["hf_single"].append(hf_single(hf, prompts[0], args.output_len))
        if quant is not None:
            res["quant_single"].append(ours_single(quant, prompts[0], args.output_len))
    report = {k: summarize(v) for k, v in res.items()}
    report["config"] = {**vars(args), "machine": platform.processor() or platform.machine(),
                        "torch": torch.__version__, "cpu_count": torch.get_num_threads()}
    t_ratio = report["ours_tput"]["median"] / report["hf_tput"]["median"]
    s_ratio = report["ours_single"]["median"] / report["hf_single"]["median"]
    report["ratios"] = {"throughput": t_ratio, "single_stream": s_ratio}
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
