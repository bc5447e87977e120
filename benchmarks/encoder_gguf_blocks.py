"""A rotary encoder GGUF's q8_0 projections kept in their blocks (the default) against dequantized on load, per model.

    python benchmarks/encoder_gguf_blocks.py [--sentences 1000] [--repeats 3] [--out benchmarks/results/encoder_gguf_blocks.md]

Real weights of these models cannot be installed here, so each is a random model with the released model's exact
sizes (nomic-embed-text-v1.5: NomicBERT, 12 layers of 768, SwiGLU 3072; ModernBERT-base: 22 layers of 768, GeGLU
1152, a local window of 128 with every third layer global), made by transformers and converted to q8_0 by llama.cpp's
convert_hf_to_gguf.py (tests/encoder_models.py, cached under benchmarks/.cache/encoder_gguf). Both loads of one file
run in this process, `--quantization auto` (blocks kept: int8 kernels) and `none` (float32 linears), alternating
repeat by repeat because the machine is shared; a row is the median wall time to embed `--sentences` prompts of
16-128 tokens (token ids drawn uniformly, the same for both), and the largest |difference| between the two loads'
unit vectors. The CPU and its flags head the result.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import lmserve  # noqa: F401  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from packed_layout import cpu  # noqa: E402  (the CPU named as every benchmark names it)

MODELS = {
    "nomic-embed-text-v1.5": ("nomic", dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                            num_hidden_layers=12, max_position_embeddings=2048)),
    "ModernBERT-base": ("modern", dict(hidden_size=768, intermediate_size=1152, num_attention_heads=12,
                                       num_hidden_layers=22, max_position_embeddings=8192, local_attention=128,
                                       global_attn_every_n_layers=3)),
}


def gguf_of(name: str) -> Path:
    """The model's q8_0 GGUF, made once."""
    from tests.encoder_models import convert_to_gguf, modernbert_for_converter, nomic_bert_for_converter

    kind, dims = MODELS[name]
    root = ROOT / ".cache" / "encoder_gguf" / name
    out = root.with_suffix(".q8_0.gguf")
    if not out.exists():
        root.mkdir(parents=True, exist_ok=True)
        path = (nomic_bert_for_converter(root, dims) if kind == "nomic" else modernbert_for_converter(root, dims=dims))
        convert_to_gguf(path, "q8_0", out, pre="modern-bert" if kind == "modern" else None)
    return out


def prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[2] + [rng.randrange(5, vocab) for _ in range(rng.randint(14, 126))] + [3] for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    import numpy as np

    from lmserve.engine.llm import LLM

    load0 = os.getloadavg()[0]
    rows, table = [], {}
    for name in MODELS:
        gguf = gguf_of(name)
        llms = {q: LLM(str(gguf), max_num_seqs=256, quantization=q, num_threads=args.threads) for q in ("auto", "none")}
        assert llms["auto"].engine.loaded.runtime_quantization == "gguf"
        batch = prompts(llms["auto"].engine.model_config.vocab_size, args.sentences)
        times: dict[str, list[float]] = {q: [] for q in llms}
        vecs = {}
        for _ in range(args.repeats):
            for q, llm in llms.items():
                t0 = time.perf_counter()
                outs = llm.embed(batch, use_tqdm=False)
                times[q].append(time.perf_counter() - t0)
                vecs[q] = np.array([o.outputs.embedding for o in outs])
        kept, dense = statistics.median(times["auto"]), statistics.median(times["none"])
        diff = float(np.abs(vecs["auto"] - vecs["none"]).max())
        table[name] = {"kept_s": times["auto"], "dequantized_s": times["none"], "max_abs_diff": diff}
        rows.append(f"| {name} | {kept:.2f} ({min(times['auto']):.2f}-{max(times['auto']):.2f}) | "
                    f"{dense:.2f} ({min(times['none']):.2f}-{max(times['none']):.2f}) | {dense / kept:.2f}x | "
                    f"{diff:.1e} |")
        del llms
    lines = [f"# Rotary encoder GGUF (q8_0): blocks kept vs dequantized, {args.sentences} prompts of 16-128 tokens, "
             f"{args.threads} threads", "", f"CPU: {cpu()}; load average {load0:.1f} before, "
             f"{os.getloadavg()[0]:.1f} after; medians (min-max) of {args.repeats} alternating repeats", "",
             "| model (random, released sizes) | kept s | dequantized s | speed-up | max abs diff of unit vectors |",
             "|---|---|---|---|---|", *rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps({"cpu": cpu(), "models": table}, indent=1))


if __name__ == "__main__":
    main()
