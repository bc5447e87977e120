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

from tests.conftest import write_tiny_llama

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
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
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
