"""c=1 decode of a W4A16 checkpoint (llm-compressor) vs the same model as a Q4_0 GGUF, both on lmserve's int kernels.

    python benchmarks/prequant_decode.py [--tokens 64] [--repeats 5] [--gptq] [--out FILE.json]

One random-weight model of SmolLM2-135M's shape (its config, the embedded file's tokenizer; seeded) is quantized
twice: by llm-compressor (W4A16, symmetric, groups of 32, the compressed-tensors format GPTQ/AWQ one-shots write;
round-to-nearest, or `--gptq`; the tied table stays unquantized, in the bfloat16 the model is in, as llm-compressor,
GPTQ and AWQ checkpoints leave the LM head; lmserve holds it in bfloat16: layers/formats/half_linear.py) and by the `gguf`
package's quantizer (Q4_0 projections, the tied token table in Q8_0, as llama.cpp's quantize gives a 576-wide
table and the embedded SmolLM2 file has it). A third variant is that GGUF with a float32 token table.
`weight_bytes` is what each reads per decoded token (lmserve.bench.roofline); `lm_head_ms` times each LM head alone
on one row (the profile of where a step's difference goes). The engines live in one process and
alternate per repeat (same prompt, greedy, EOS ignored); each repeat's median decode step is kept, with the
machine's load average (the machine is shared: compare the ratio, not the absolute numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import lmserve  # noqa: F401  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_decode import cpu  # noqa: E402

from lmserve.bench.roofline import weight_bytes  # noqa: E402
from lmserve.config import CacheConfig, EngineConfig  # noqa: E402
from lmserve.engine.llm_engine import LLMEngine  # noqa: E402
from lmserve.loader import default_model_path  # noqa: E402
from lmserve.sampling_params import SamplingParams  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def random_smollm2(out: Path) -> Path:
    """SmolLM2-135M's shape with random weights (seeded), in bfloat16 as such checkpoints ship; its tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    src = default_model_path()
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(out)
    return out


def w4a16(base: Path, out: Path, gptq: bool) -> Path:
    """llm-compressor's W4A16 (symmetric, groups of 32: 576 columns are no multiple of 128): round-to-nearest by
    default (seconds), or its GPTQ one-shot on random calibration tokens (`gptq`: ~10 minutes on 2 loaded cores).
    Either writes the same pack-quantized format; how the codes were chosen does not change a decode step."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, symmetric=True, strategy="group", group_size=32))}
    if gptq:
        g = torch.Generator().manual_seed(1)
        ids = [torch.randint(0, 49152, (64,), generator=g).tolist() for _ in range(8)]
        data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 64] * 8})
        oneshot(model=model, processor=AutoTokenizer.from_pretrained(base), dataset=data, num_calibration_samples=8,
                max_seq_length=64, recipe=GPTQModifier(ignore=["lm_head"], config_groups=groups))
    else:
        oneshot(model=model, recipe=QuantizationModifier(ignore=["lm_head"], config_groups=groups))
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def gguf_tensors(base: Path) -> dict[str, tuple[np.ndarray, object]]:
    """GGUF name -> (data, type) of everything but the token table: Q4_0 projections (q/k rows in llama.cpp's
    order), F32 norms. Quantized by the `gguf` package."""
    from gguf import GGMLQuantizationType, quants
    from safetensors.torch import load_file

    heads = {"q_proj": 9, "k_proj": 3}
    out = {}
    for name, t in load_file(str(base / "model.safetensors")).items():
        if not name.startswith("model.layers.") and name != "model.norm.weight":
            continue  # the token table: written per variant
        w = t.float().numpy()
        if name == "model.norm.weight":
            out["output_norm.weight"] = w, GGMLQuantizationType.F32
            continue
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        part = rest.removesuffix(".weight")
        if w.ndim == 1:
            out[f"blk.{i}.{GGUF_NAMES[part]}.weight"] = w, GGMLQuantizationType.F32
            continue
        if part.split(".")[-1] in heads:  # llama.cpp interleaves each head's two rotary halves
            n = heads[part.split(".")[-1]]
            w = w.reshape(n, 2, w.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(w.shape)
        q4_0 = GGMLQuantizationType.Q4_0
        out[f"blk.{i}.{GGUF_NAMES[part]}.weight"] = quants.quantize(np.ascontiguousarray(w), q4_0), q4_0
    return out


def q4_0_gguf(base: Path, layers: dict[str, tuple[np.ndarray, object]], out: Path, table: str) -> Path:
    """A Q4_0 GGUF of the model: `layers` (gguf_tensors), the token table in `table` (Q8_0 or F32), the embedded
    SmolLM2 file's metadata (its tokenizer, this shape)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants
    from safetensors import safe_open

    reader = GGUFReader(default_model_path())
    writer = GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(2)  # MOSTLY_Q4_0
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        embd = f.get_tensor("model.embed_tokens.weight").float().numpy()
    kind = GGMLQuantizationType[table]
    tensors = {"token_embd.weight": (embd if table == "F32" else quants.quantize(embd, kind), kind)} | layers
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def decode_step_ms(engine: LLMEngine, rid: str, tokens: int) -> tuple[float, list[int]]:
    """Median wall time of one greedy request's decode steps (its prefill excluded), and its tokens."""
    engine.add_request(rid, PROMPT, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    out = [t for d in engine.step() for t in d.token_ids]
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        out += [t for d in engine.step() for t in d.token_ids]
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, out


def head_ms(engines: dict[str, LLMEngine], repeats: int = 30) -> dict[str, float]:
    """Median time of each model's LM head alone on one row (the engines interleaved): the part of a decode step
    that the checkpoint's unquantized head costs."""
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(0))
    times = {k: [] for k in engines}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.loaded.model.compute_logits(x)
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--gptq", action="store_true", help="GPTQ one-shot instead of round-to-nearest (slow)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # the GGUF files here live as long as this run: their repacked-weight cache entries (~115 MB each) too
        os.environ.setdefault("LMSERVE_WEIGHT_CACHE", str(Path(tmp) / "start-cache"))
        base = random_smollm2(Path(tmp) / "base")
        made = time.perf_counter()
        layers = gguf_tensors(base)
        models = {"w4a16_g32": w4a16(base, Path(tmp) / "w4a16", args.gptq),
                  "gguf_q4_0": q4_0_gguf(base, layers, Path(tmp) / "q4_0.gguf", "Q8_0"),
                  "gguf_q4_0_float_head": q4_0_gguf(base, layers, Path(tmp) / "q4_0_f32.gguf", "F32")}
        del layers
        quantize_s = time.perf_counter() - made
        engines = {k: LLMEngine(EngineConfig(model=str(p), num_threads=args.threads, cache=CacheConfig(num_blocks=64)))
                   for k, p in models.items()}
        formats = {k: e.loaded.weight_format for k, e in engines.items()}
        read = {k: weight_bytes(e.loaded.model) for k, e in engines.items()}
        heads = {k: type(e.loaded.model.lm_head).__name__ for k, e in engines.items()}
        load_before = os.getloadavg()
        steps, tokens = {k: [] for k in engines}, {}
        for r in range(args.repeats):
            for name, engine in engines.items():
                ms, tokens[name] = decode_step_ms(engine, f"r{r}", args.tokens)
                steps[name].append(ms)
        head = head_ms(engines)
    median = {k: statistics.median(v) for k, v in steps.items()}
    result = {"cpu": cpu(), "threads": torch.get_num_threads(), "load_avg_before": load_before,
              "load_avg_after": os.getloadavg(), "tokens": args.tokens, "quantize_seconds": round(quantize_s, 1),
              "weight_format": formats, "weight_bytes": read, "lm_head": heads, "decode_step_ms": steps,
              "lm_head_ms": head, "median_ms": median,
              "median_without_head_ms": {k: median[k] - head[k] for k in median},
              "quantizer": "llmcompressor GPTQ one-shot" if args.gptq else "llmcompressor round-to-nearest",
              "w4a16_vs_q4_0": median["gguf_q4_0"] / median["w4a16_g32"],
              "w4a16_vs_q4_0_float_head": median["gguf_q4_0_float_head"] / median["w4a16_g32"],
              # the same random model quantized twice: how many greedy tokens the two 4-bit versions share
              "same_greedy_tokens": sum(a == b for a, b in zip(tokens["w4a16_g32"], tokens["gguf_q4_0"]))}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
