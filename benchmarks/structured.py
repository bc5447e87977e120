"""Structured outputs: constrained vs unconstrained decode throughput, and grammar compile times.

    python benchmarks/structured.py            # ~3 min on 2 cores; writes results/structured.{json,md}

Throughput (batch 16, the same 16 chat prompts, side by side in one process): the constrained run uses
a nested JSON schema at temperature 1; the unconstrained run then generates exactly as many tokens per
request (ignore_eos, max_tokens = that request's constrained length), so both runs have the same batch
shape at every step and the difference is what the grammar costs (bitmask filling, masking, matcher
updates). Compile times: each spec of the test set compiled cold (a fresh compiler: the child process
already started, nothing cached) and again from the cache.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from compare import _cpu_name, _flags  # noqa: E402  benchmarks/compare.py: the same machine description

from lmserve import LLM, SamplingParams  # noqa: E402
from lmserve.parsers.tool_grammar import tool_call_tag  # noqa: E402
from lmserve.sampling_params import StructuredOutputsParams  # noqa: E402
from lmserve.structured.compiler import GrammarCompiler, VocabInfo  # noqa: E402
from tests.test_server_structured import ORDER, TOOLS, WEATHER  # noqa: E402
from tests.test_structured import PERSON  # noqa: E402

SPECS = {
    "json: order (nested)": {"json": ORDER},
    "json: person": {"json": PERSON},
    "json: weather": {"json": WEATHER},
    "json_object": {"json_object": True},
    "regex: ISO date": {"regex": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"},
    "regex: phone": {"regex": r"\+1 \(\d{3}\) \d{3}-\d{4}"},
    "choice: 3": {"choice": ["positive", "negative", "neutral"]},
    "grammar: greeting": {"grammar": 'root ::= greeting " " name "!"\ngreeting ::= "Hello" | "Hi"\n'
                                     'name ::= [A-Z] [a-z]{1,8}'},
    "tools: 3, auto": {"structural_tag": tool_call_tag(TOOLS, "auto")},
    "tools: 3, required": {"structural_tag": tool_call_tag(TOOLS, "required")},
}


def throughput(llm: LLM, batch: int, repeats: int) -> dict:
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": f"Write order number {i} as JSON."}])
               for i in range(batch)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_outputs={"json": ORDER}), use_tqdm=False)
    runs = {"constrained": [], "unconstrained": []}
    steps = 0
    for r in range(repeats):
        constrained = SamplingParams(temperature=1.0, seed=r, max_tokens=256, structured_outputs={"json": ORDER})
        t, s0 = time.perf_counter(), llm.engine.num_steps
        outs = llm.generate(prompts, constrained, use_tqdm=False)
        runs["constrained"].append((time.perf_counter() - t, outs))
        steps += llm.engine.num_steps - s0
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        plain = [SamplingParams(temperature=1.0, seed=r, max_tokens=n, ignore_eos=True) for n in lengths]
        t = time.perf_counter()
        plain_outs = llm.generate(prompts, plain, use_tqdm=False)
        runs["unconstrained"].append((time.perf_counter() - t, plain_outs))
    for o in runs["constrained"][-1][1]:
        json.loads(o.outputs[0].text)  # every constrained output parses (the tests validate them fully)
    rates = {k: [sum(len(o.outputs[0].token_ids) for o in outs) / dt for dt, outs in v] for k, v in runs.items()}
    return {"batch": batch, "repeats": repeats,
            "tok_s": {k: statistics.median(v) for k, v in rates.items()},
            "tok_s_all": rates,
            "ratio": statistics.median(rates["constrained"]) / statistics.median(rates["unconstrained"]),
            "tokens_per_request": statistics.mean(len(o.outputs[0].token_ids) for o in runs["constrained"][-1][1]),
            "steps": steps, "mask_s_last_step": llm.engine.last_step.grammar_mask_s}


def compile_times(llm: LLM) -> dict:
    tok = llm.tokenizer
    vocab = VocabInfo(tok.vocab_tokens(), tok.vocab_type, llm.engine.model_config.vocab_size, sorted(tok.eos_token_ids))
    compiler = GrammarCompiler(vocab)
    compiler.compile(StructuredOutputsParams(regex="warm"))  # start the child process outside the timings
    out = {}
    for name, spec in SPECS.items():
        p = StructuredOutputsParams.from_dict(spec)
        cold, cached = compiler.compile(p), compiler.compile(p)
        assert not cold.cached and cached.cached
        out[name] = {"cold_ms": cold.seconds * 1e3, "cached_ms": cached.seconds * 1e3}
    compiler.close()
    cold = sorted(v["cold_ms"] for v in out.values())
    cached = sorted(v["cached_ms"] for v in out.values())
    return {"specs": out, "cold_p50_ms": _pct(cold, 50), "cold_p95_ms": _pct(cold, 95),
            "cached_p50_ms": _pct(cached, 50), "cached_p95_ms": _pct(cached, 95)}


def _pct(sorted_values: list[float], p: float) -> float:
    k = min(len(sorted_values) - 1, round(p / 100 * (len(sorted_values) - 1)))
    return sorted_values[k]


def mask_step_cost(llm: LLM, batch: int) -> dict:
    """Mean time to fill the bitmask per step at this batch (from the engine's step stats)."""
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": f"Order {i} as JSON."}]) for i in range(batch)]
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=40, structured_outputs={"json": ORDER})
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"mask-{i}", p, params)
    fills = []
    while llm.engine.has_unfinished():
        llm.engine.step()
        if llm.engine.last_step.grammar_mask_s:
            fills.append(llm.engine.last_step.grammar_mask_s)
    return {"batch": batch, "steps": len(fills), "fill_ms_mean": statistics.mean(fills) * 1e3,
            "fill_ms_max": max(fills) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "structured"))
    args = ap.parse_args()
    llm = LLM(num_threads=2, kv_cache_memory=256 * 2**20, dtype="float32")
    report = {"machine": {"cpu": _cpu_name(), "flags": _flags(), "python": platform.python_version()},
              "command": "python benchmarks/structured.py " + " ".join(sys.argv[1:]),
              "throughput": throughput(llm, args.batch, args.repeats),
              "mask": mask_step_cost(llm, args.batch),
              "compile": compile_times(llm)}
    Path(args.out + ".json").write_text(json.dumps(report, indent=2))
    Path(args.out + ".md").write_text(render(report))
    print(render(report))
    return 0


def render(r: dict) -> str:
    t, m, c = r["throughput"], r["mask"], r["compile"]
    met = "met" if t["ratio"] >= 0.9 else "NOT met"
    lines = [f"Structured outputs, {r['machine']['cpu']} ({r['machine']['flags']}), float32, 2 threads. "
             f"Command: `{r['command'].strip()}`", "",
             f"| batch {t['batch']}, same prompts and token counts | tok/s (median of {t['repeats']}) |",
             "| --- | --- |",
             f"| unconstrained | {t['tok_s']['unconstrained']:.1f} |",
             f"| JSON schema (nested order), T=1 | {t['tok_s']['constrained']:.1f} |",
             f"| ratio | {t['ratio']:.3f}x (target >= 0.9x: {met}) |", "",
             f"Mean output {t['tokens_per_request']:.0f} tokens per request. Bitmask fill per step at batch "
             f"{m['batch']}: mean {m['fill_ms_mean']:.2f} ms, max {m['fill_ms_max']:.2f} ms over {m['steps']} steps.",
             "", "| spec | cold compile, ms | cached, ms |", "| --- | --- | --- |"]
    lines += [f"| {name} | {v['cold_ms']:.1f} | {v['cached_ms']:.3f} |" for name, v in c["specs"].items()]
    lines += ["", f"Cold: p50 {c['cold_p50_ms']:.1f} ms, p95 {c['cold_p95_ms']:.1f} ms. "
              f"Cached: p50 {c['cached_p50_ms']:.3f} ms, p95 {c['cached_p95_ms']:.3f} ms.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
