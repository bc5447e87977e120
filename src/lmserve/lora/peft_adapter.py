"""Read and check a PEFT LoRA adapter directory into plain data (interim copy of branch lora-merge's interface)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from lmserve.models.config import ModelConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoraModule:
    """One projection's adapter: delta W = scaling * b @ a."""

    a: torch.Tensor  # [rank, in_features] float32
    b: torch.Tensor  # [out_features, rank] float32
    scaling: float


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT LoRA adapter read into memory and checked against a base model."""

    name: str
    path: str
    rank: int
    target_modules: tuple[str, ...]
    modules: dict[tuple[int, str], LoraModule]

    @property
    def nbytes(self) -> int:
        """Bytes of all a and b tensors."""
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())


class AdapterError(ValueError):
    """An adapter that cannot be served, with one clear message."""


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (cfg.q_size, h), "k_proj": (cfg.kv_size, h), "v_proj": (cfg.kv_size, h),
            "o_proj": (h, cfg.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def read_peft_adapter(path: str | os.PathLike, cfg: ModelConfig, *, name: str, max_rank: int = 64) -> PeftAdapter:
    """Read `path`'s adapter_config.json and adapter_model.safetensors; AdapterError names any problem."""
    d = Path(path)
    conf_file, weights = d / "adapter_config.json", d / "adapter_model.safetensors"
    if not conf_file.is_file():
        raise AdapterError(f"{d}: no adapter_config.json (not a PEFT adapter directory)")
    if not weights.is_file():
        if (d / "adapter_model.bin").is_file():
            raise AdapterError(f"{d}: only a pickle adapter_model.bin; convert it to adapter_model.safetensors")
        raise AdapterError(f"{d}: no adapter_model.safetensors")
    try:
        conf = json.loads(conf_file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{conf_file}: {e}") from None
    _check_config(conf)
    modules = _read_modules(weights, conf, cfg, max_rank)
    rank = max(m.a.shape[0] for m in modules.values())
    targets = tuple(sorted({p for _, p in modules}))
    return PeftAdapter(name, str(d), rank, targets, modules)


def _check_config(conf: dict) -> None:
    if conf.get("peft_type") != "LORA":
        raise AdapterError(f"peft_type {conf.get('peft_type')!r} is not supported (only LORA)")
    if conf.get("modules_to_save"):
        raise AdapterError("modules_to_save is not supported")
    if conf.get("use_dora"):
        raise AdapterError("DoRA (use_dora) is not supported")
    if conf.get("bias", "none") != "none":
        raise AdapterError(f"bias {conf.get('bias')!r} is not supported (only 'none')")
    targets = conf.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    bad = [t for t in targets if t not in PROJECTIONS]
    if bad:
        raise AdapterError(f"target modules {bad} are not supported (embedding/lm_head LoRA included); "
                           f"supported: {', '.join(PROJECTIONS)}")


def _scaling(conf: dict, key: str, rank: int) -> float:
    alpha = conf.get("lora_alpha", 8)
    for pattern, value in (conf.get("alpha_pattern") or {}).items():
        if re.search(pattern, key):
            alpha = value
    return alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank


def _read_modules(weights: Path, conf: dict, cfg: ModelConfig, max_rank: int) -> dict[tuple[int, str], LoraModule]:
    shapes = _shapes(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            m = _NAME.match(key)
            if m is None or m.group(3) not in PROJECTIONS or int(m.group(1)) >= cfg.num_layers:
                raise AdapterError(f"{weights.name}: unexpected tensor {key!r}")
            parts.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = f.get_tensor(key).float()
    modules = {}
    for (layer, proj), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights.name}: layer {layer} {proj} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        rank = a.shape[0]
        if rank > max_rank:
            raise AdapterError(f"rank {rank} exceeds --max-lora-rank {max_rank}")
        out_f, in_f = shapes[proj]
        for t, want, nm in ((a, (rank, in_f), "lora_A"), (b, (out_f, rank), "lora_B")):
            if tuple(t.shape) != want:
                raise AdapterError(f"tensor layers.{layer}.{proj}.{nm} has shape {tuple(t.shape)}, "
                                   f"the base model needs {want}")
        modules[(layer, proj)] = LoraModule(a.contiguous(), b.contiguous(), _scaling(conf, f"layers.{layer}.{proj}", rank))
    if not modules:
        raise AdapterError(f"{weights.name}: no LoRA tensors")
    return modules
