"""QLoRA merge: how far a merged export's logits are from the adapter served unmerged on the 4-bit base.

    PYTHONPATH=src python benchmarks/lora_merge_qlora.py [--rank 16] [--out benchmarks/results/lora_merge_qlora.json]

The base is the embedded Q4_1 GGUF (or `--base DIR --quantization int4` for a safetensors checkpoint); the
adapter is a random PEFT-format rank-`--rank` adapter on all seven projections (A like PEFT's kaiming init, B
random so it matters). The reference is lmserve's float32 model on the dequantized 4-bit weights with the
adapter applied unmerged (forward hooks: x @ A^T @ B^T * scaling beside each projection, fused q/k/v and
gate/up columns included). Against it: `lmserve lora merge` exports in float32 and bfloat16, loaded by lmserve
(float32 compute; the bf16 export also in bf16 compute), and, for scale, the same unmerged adapter on the int4
kernels (`--quantization int4`: bf16 activations, int8 LM head). Reported per variant over every position of
a few prompts: max |logit difference| and top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import lmserve  # noqa: F401  before torch: libgomp's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as the CLI has)

# isort: split
import torch
from safetensors.torch import save_file

from lmserve.layers.attention.context import ContiguousAttention
from lmserve.loader import load_model, read_model_config, resolve_model_path
from lmserve.lora.export import round_trip
from lmserve.lora.merge import MergeSpec, merge_to_directory
from lmserve.lora.peft_adapter import PROJECTIONS, expected_shapes, read_peft_adapter
from lmserve.tokenizer import Tokenizer
from lmserve.worker.transforms import load_formatted

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "Low-rank adaptation adds a small trainable update to each weight matrix, so that",
           "<|im_start|>user\nWrite a haiku about quantization.<|im_end|>\n<|im_start|>assistant\n"]
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def write_random_adapter(out: Path, cfg, rank: int, seed: int, b_std: float = 0.08) -> Path:
    """A PEFT-format LoRA adapter (adapter_config.json + adapter_model.safetensors) on all seven projections."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj, group in PROJECTIONS.items():
            (r, k), (n, _) = expected_shapes(proj, rank, cfg)
            prefix = f"base_model.model.model.layers.{layer}.{group}.{proj}"
            tensors[prefix + ".lora_A.weight"] = (torch.rand(r, k, generator=g) * 2 - 1) / math.sqrt(k)
            tensors[prefix + ".lora_B.weight"] = torch.randn(n, r, generator=g) * b_std
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
              "bias": "none", "use_rslora": False, "task_type": "CAUSAL_LM"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def add_unmerged(model, adapter, cfg) -> None:
    """Forward hooks that add each projection's LoRA delta beside the (packed or quantized) base layer."""
    sizes = {"qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size], "gate_up_proj": [cfg.intermediate_size] * 2}
    for (layer, proj), m in adapter.modules.items():
        block = model.model.layers[layer]
        name, part = FUSED.get(proj, (proj, 0))
        linear = getattr(block.self_attn if hasattr(block.self_attn, name) else block.mlp, name)
        start = sum(sizes.get(name, [0])[:part])

        def hook(_mod, inputs, out, m=m, start=start):
            out = out.clone()
            delta = (inputs[0].float() @ m.a.T @ m.b.T) * m.scaling
            out[..., start:start + delta.shape[-1]] += delta.to(out.dtype)
            return out

        linear.register_forward_hook(hook)


def logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Every position's logits (float32), all prompts in one flat forward."""
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.inference_mode():
        return model.compute_logits(model(ids, pos, ContiguousAttention([len(p) for p in prompts]))).float()


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    return {"max_abs_diff": round((got - ref).abs().max().item(), 6),
            "top1_agreement": round((got.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
            "positions": ref.shape[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default=None, help="a .gguf file or HF directory (default: the embedded Q4_1 GGUF)")
    p.add_argument("--quantization", default=None, choices=["int4", "int8"],
                   help="the base's 4-bit format for a safetensors base (a GGUF is merged as stored)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the results as JSON here (and a .md table beside it)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base = resolve_model_path(args.base)
    cfg = read_model_config(base)
    tok = Tokenizer.from_pretrained(base) if base.is_dir() else Tokenizer.from_gguf(base)
    prompts = [tok.encode_prompt(t) for t in PROMPTS]
    work = Path(tempfile.mkdtemp(prefix="qlora-"))
    adapter_dir = write_random_adapter(work / "adapter", cfg, args.rank, args.seed)
    adapter = read_peft_adapter(adapter_dir, cfg, name="adapter")
    start = time.perf_counter()

    ref_model = load_model(base, torch.float32, torch.device("cpu")).model
    if args.quantization:  # the reference's base is the quantized weights, dequantized (row-wise, so fused is fine)
        with torch.no_grad():
            for name, w in ref_model.named_parameters():
                if w.dim() == 2 and any(k in name for k in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
                    w.copy_(round_trip(w, args.quantization))
    base_logits = logits(ref_model, prompts)
    add_unmerged(ref_model, adapter, cfg)
    ref = logits(ref_model, prompts)
    del ref_model
    rows = {"base alone (no adapter), float32": compare(base_logits, ref)}

    int4 = load_formatted(base, torch.float32, torch.device("cpu"), quantization="int4").model
    add_unmerged(int4, adapter, cfg)
    rows["unmerged on the int4 kernels (bf16 activations, int8 LM head)"] = compare(logits(int4, prompts), ref)
    del int4
    for dtype, computes in (("float32", ("float32",)), ("bfloat16", ("float32", "bfloat16"))):
        out = work / f"merged-{dtype}"
        merge_to_directory(base, cfg, [adapter_dir], MergeSpec((1.0,)), out, dtype, args.quantization)
        for compute in computes:
            model = load_formatted(out, getattr(torch, compute), torch.device("cpu")).model
            rows[f"merged export {dtype}, {compute} compute"] = compare(logits(model, prompts), ref)
            del model
    result = {"base": str(base.name), "quantization": args.quantization or "GGUF as stored", "rank": args.rank,
              "adapter_scaling": 2.0, "reference": "float32, dequantized 4-bit base + adapter unmerged",
              "max_abs_ref_logit": round(ref.abs().max().item(), 3), "threads": args.threads,
              "seconds": round(time.perf_counter() - start, 1), "rows": rows}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(markdown(result))


def markdown(r: dict) -> str:
    lines = [f"QLoRA merge on {r['base']} ({r['quantization']}), rank-{r['rank']} adapter on all projections; "
             f"reference: {r['reference']} (max |logit| {r['max_abs_ref_logit']}), "
             f"{next(iter(r['rows'].values()))['positions']} positions over {len(PROMPTS)} prompts.", "",
             "| variant | max abs logit diff | top-1 agreement |", "|---|---|---|"]
    lines += [f"| {k} | {v['max_abs_diff']:.2e} | {100 * v['top1_agreement']:.1f}% |" for k, v in r["rows"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
