"""Test helpers (not a test module): PEFT LoRA adapters made here with `peft`, and transformers + PEFT references.

`base` is the embedded GGUF file (transformers loads it with `gguf_file=`, dequantized to float32) or a
Hugging Face directory such as the tiny random Llama `tiny_llama_checkpoint` writes. The transformers
model for a base is loaded once per process and shared: PEFT injects its layers in place, so every
helper here takes them out again (`unload()`) before returning.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Iterator, Sequence

import torch

from tests.conftest import hf_from_gguf, write_tiny_llama

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
B_STD = 0.08  # lora_B init: logits move by ~4 (embedded model, rank 8 q/v), so greedy tokens differ from the base


def tiny_llama_checkpoint(directory: Path) -> Path:
    """A tiny random Llama HF checkpoint (config.json, model.safetensors, tokenizer.json) under `directory`."""
    path = Path(directory) / "tiny-llama"
    if not path.exists():
        write_tiny_llama(path)
    return path


@functools.lru_cache(maxsize=2)
def hf_base_model(base: str) -> torch.nn.Module:
    """The transformers float32 model for `base` (a .gguf file or an HF directory), loaded once per process."""
    import transformers

    path = Path(base)
    if path.suffix == ".gguf":
        model = hf_from_gguf(path)
    else:  # tests' tiny checkpoints have no model_type: pick the class from `architectures`
        arch = json.loads((path / "config.json").read_text())["architectures"][0]
        model = getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def make_peft_adapter(out_dir: Path, base: str | Path, *, rank: int = 8,
                      target_modules: Sequence[str] = ("q_proj", "v_proj"), seed: int = 0, alpha: float = 16,
                      use_rslora: bool = False) -> Path:
    """Write a PEFT LoRA adapter for `base` into `out_dir`, with random non-zero lora_B so it changes the output."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        use_rslora=use_rslora, bias="none", task_type="CAUSAL_LM")
    base_model = hf_base_model(str(base))
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # lora_A's kaiming init draws from the global generator
        peft_model = get_peft_model(base_model, config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * B_STD)
    out = Path(out_dir)
    peft_model.save_pretrained(str(out))
    peft_model.unload()  # the shared base model gets its plain Linear layers back
    return out


@contextlib.contextmanager
def peft_reference(base: str | Path, adapter_dir: Path) -> Iterator[torch.nn.Module]:
    """transformers + PEFT (float32, unmerged) with `adapter_dir` applied to `base`; unloaded on exit."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_base_model(str(base)), str(adapter_dir)).eval()
    try:
        yield model
    finally:
        model.unload()


def reference_logits(model: torch.nn.Module, prompt: Sequence[int]) -> torch.Tensor:
    """[len(prompt), vocab] float32 logits of a transformers (or PEFT) model for one prompt."""
    with torch.no_grad():
        return model(torch.tensor([list(prompt)])).logits[0].float()


def write_random_adapter(out_dir: Path, cfg, *, rank: int = 8, target_modules: Sequence[str] = ALL_PROJECTIONS,
                         seed: int = 0, alpha: float = 16) -> Path:
    """A PEFT-format LoRA adapter for the base `cfg` (a ModelConfig) written directly, without loading the base
    in transformers (fast: for tests that need a valid adapter, not PEFT's numbers)."""
    from safetensors.torch import save_file

    from lmserve.lora.peft_adapter import PROJECTIONS, expected_shapes

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj in target_modules:
            (r, k), (n, _) = expected_shapes(proj, rank, cfg)
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
            tensors[prefix + ".lora_A.weight"] = (torch.rand(r, k, generator=g) * 2 - 1) / k**0.5  # kaiming-like
            tensors[prefix + ".lora_B.weight"] = torch.randn(n, r, generator=g) * B_STD
    out = Path(out_dir)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(target_modules),
              "bias": "none", "use_rslora": False, "task_type": "CAUSAL_LM"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
