"""Combine several LoRA adapters into one, as PEFT's `add_weighted_adapter` defines each method.

Every method acts per adapted projection and returns one `LoraModule` per (layer, projection):
- a single adapter: `a`, `b` as they are, scaling = weight * the adapter's own scaling (an exact merge);
- `cat`: A rows stacked (each scaled by weight * scaling), B columns stacked; rank = sum of ranks; exact;
- `linear`, `ties`, `dare_linear`, `dare_ties`: A and B combined separately, each adapter's A taking
  sign(w*s) * sqrt(|w*s|) and its B sqrt(|w*s|) (w: its weight, s: its scaling); `linear` sums,
  `ties` keeps each tensor's top `density` fraction by magnitude then averages the entries that
  agree with the majority sign, `dare_*` drop entries at random (kept with probability `density`,
  survivors divided by it) then sum (`dare_linear`) or sign-elect (`dare_ties`). These need one rank.
The combined module's scaling is 1 (PEFT sets the new adapter's lora_alpha = r). One difference on
purpose: PEFT keeps the first adapter's `use_rslora`, which turns that 1 into sqrt(r); we do not.

DARE's random drops come from torch's generator seeded with `seed`, drawn in PEFT's order: module by
module (layer, then q k v o gate up down), within a module every adapter's A, then every adapter's B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from lmserve.errors import ConfigError
from lmserve.loader.header import read_config
from lmserve.lora.export import DTYPES, ExportResult, export_merged
from lmserve.lora.peft_adapter import PROJECTIONS, AdapterError, LoraModule, PeftAdapter, read_peft_adapter
from lmserve.models.config import ModelConfig

METHODS = ("linear", "cat", "ties", "dare_linear", "dare_ties")
_NEEDS_DENSITY = ("ties", "dare_linear", "dare_ties")
MAX_MERGE_RANK = 4096  # merging is offline: no serving slot bounds the rank, only sanity does


@dataclass(frozen=True)
class MergeSpec:
    """How to combine adapters: one weight per adapter, the method, its density and DARE's seed."""

    weights: tuple[float, ...]
    method: str = "linear"
    density: float | None = None
    seed: int = 0

    def check(self, num_adapters: int) -> None:
        """Refuse a spec that cannot apply to `num_adapters` adapters (ConfigError naming the flag)."""
        if self.method not in METHODS:
            raise ConfigError(f"--method {self.method!r} is not a merge method (choose from {', '.join(METHODS)})")
        if len(self.weights) != num_adapters:
            raise ConfigError(f"--weights has {len(self.weights)} value(s) but {num_adapters} adapter(s) were given")
        if not all(math.isfinite(w) for w in self.weights):
            raise ConfigError(f"--weights must be finite numbers, got {list(self.weights)}")
        if self.method in _NEEDS_DENSITY and num_adapters > 1:
            if self.density is None:
                raise ConfigError(f"--method {self.method} needs --density (the fraction of entries kept, in (0, 1])")
        if self.density is not None:
            if self.method not in _NEEDS_DENSITY:
                raise ConfigError(f"--density applies to {', '.join(_NEEDS_DENSITY)}, not to --method {self.method}")
            if not (0 < self.density <= 1):
                raise ConfigError(f"--density must be in (0, 1], got {self.density}")


def combine(adapters: Sequence[PeftAdapter], spec: MergeSpec) -> dict[tuple[int, str], LoraModule]:
    """One LoraModule per projection any adapter adapts: the adapters combined by `spec`."""
    spec.check(len(adapters))
    keys = sorted({k for a in adapters for k in a.modules}, key=lambda k: (k[0], list(PROJECTIONS).index(k[1])))
    if len(adapters) == 1:  # PEFT also falls back to linear here; kept exact: no sqrt split of the weight
        (w,) = spec.weights
        return {k: LoraModule(m.a, m.b, m.scaling * w) for k, m in adapters[0].modules.items()}
    if spec.method != "cat" and len({a.rank for a in adapters}) > 1:
        raise ConfigError(f"--method {spec.method} needs adapters of one rank, got ranks "
                          f"{[a.rank for a in adapters]} (--method cat takes any ranks)")
    combine_one = _cat if spec.method == "cat" else _factorwise(spec)
    with torch.random.fork_rng():  # DARE's draws: reproducible from the seed, the caller's generator untouched
        torch.manual_seed(spec.seed)
        return {k: combine_one([(a.modules[k], w) for a, w in zip(adapters, spec.weights) if k in a.modules])
                for k in keys}


def _cat(parts: list[tuple[LoraModule, float]]) -> LoraModule:
    """Stack ranks: delta = sum_i w_i s_i B_i A_i exactly."""
    a = torch.cat([m.a * (w * m.scaling) for m, w in parts], dim=0)  # [sum of ranks, in]
    b = torch.cat([m.b for m, _ in parts], dim=1)  # [out, sum of ranks]
    return LoraModule(a, b, 1.0)


def _factorwise(spec: MergeSpec) -> Callable[[list[tuple[LoraModule, float]]], LoraModule]:
    """linear / ties / dare_*: A and B each combined by the method, with sqrt-split weights."""
    merge = _MERGERS[spec.method]

    def combine_one(parts: list[tuple[LoraModule, float]]) -> LoraModule:
        if len({m.rank for m, _ in parts}) > 1:  # rank_pattern can differ per projection under one max rank
            raise ConfigError(f"--method {spec.method} needs every adapted projection at one rank, got ranks "
                              f"{[m.rank for m, _ in parts]} on one of them (--method cat takes any ranks)")
        ws = [w * m.scaling for m, w in parts]
        wa = torch.tensor([math.copysign(math.sqrt(abs(x)), x) if x else 0.0 for x in ws])
        wb = torch.tensor([math.sqrt(abs(x)) for x in ws])
        a = merge([m.a for m, _ in parts], wa, spec.density)
        b = merge([m.b for m, _ in parts], wb, spec.density)
        return LoraModule(a, b, 1.0)

    return combine_one


def _weighted(stack: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[n, ...] * [n] broadcast over the trailing dims."""
    return stack * weights.reshape(-1, *([1] * (stack.dim() - 1)))


def _linear(tensors: list[torch.Tensor], weights: torch.Tensor, density: float | None) -> torch.Tensor:
    return _weighted(torch.stack(tensors), weights).sum(0)


def _ties(tensors: list[torch.Tensor], weights: torch.Tensor, density: float | None) -> torch.Tensor:
    return _sign_elect(torch.stack([keep_top(t, density) for t in tensors]), weights)


def _dare_linear(tensors: list[torch.Tensor], weights: torch.Tensor, density: float | None) -> torch.Tensor:
    return _weighted(torch.stack([drop_random(t, density) for t in tensors]), weights).sum(0)


def _dare_ties(tensors: list[torch.Tensor], weights: torch.Tensor, density: float | None) -> torch.Tensor:
    return _sign_elect(torch.stack([drop_random(t, density) for t in tensors]), weights)


_MERGERS = {"linear": _linear, "ties": _ties, "dare_linear": _dare_linear, "dare_ties": _dare_ties}


def keep_top(t: torch.Tensor, density: float | None) -> torch.Tensor:
    """TIES trim: zero all but the int(density * numel) entries of largest magnitude."""
    if density is None or density >= 1:
        return t
    k = int(density * t.numel())
    keep = torch.zeros(t.numel(), dtype=t.dtype)
    keep[torch.topk(t.abs().flatten(), k=k).indices] = 1
    return t * keep.reshape(t.shape)


def drop_random(t: torch.Tensor, density: float | None) -> torch.Tensor:
    """DARE: keep each entry with probability `density` (torch's global generator) and rescale by 1/density."""
    if density is None or density >= 1:
        return t
    return t * torch.bernoulli(torch.full_like(t, density)) / density


def _sign_elect(stack: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """TIES's elect + disjoint mean: the majority sign (by total of the trimmed values) per entry, then the
    mean of the weighted entries that carry it."""
    sign = stack.sign()
    majority = torch.where(stack.sum(0) >= 0, 1.0, -1.0)
    agree = sign == majority
    return (_weighted(stack, weights) * agree).sum(0) / agree.sum(0).clamp(min=1)


@dataclass(frozen=True)
class MergeResult:
    """What `merge_to_directory` did, for the CLI's summary line."""

    adapters: tuple[str, ...]
    export: ExportResult
    dtype: torch.dtype


def merge_to_directory(base: Path, cfg: ModelConfig, adapter_dirs: Sequence[Path], spec: MergeSpec, out: Path,
                       dtype: str = "auto", quantization: str | None = None) -> MergeResult:
    """Read and check every adapter against `cfg`, combine them by `spec`, and export base + result to `out`."""
    if not adapter_dirs:
        raise ConfigError("lora merge needs at least one --adapter")
    if quantization not in (None, "int4", "int8"):
        raise ConfigError(f"--quantization {quantization!r}: choose int4 or int8")
    try:
        adapters = [read_peft_adapter(d, cfg, name=Path(d).name, max_rank=MAX_MERGE_RANK) for d in adapter_dirs]
    except AdapterError as e:
        raise ConfigError(str(e)) from None
    modules = combine(adapters, spec)
    torch_dtype = export_dtype(base, dtype)
    result = export_merged(base, cfg, modules, out, torch_dtype, quantization)
    return MergeResult(tuple(a.name for a in adapters), result, torch_dtype)


def export_dtype(base: Path, name: str) -> torch.dtype:
    """--dtype: auto keeps a Hugging Face base's config dtype (float32 if it names none); a GGUF gets bfloat16."""
    if name != "auto":
        if name not in DTYPES:
            raise ConfigError(f"--dtype {name!r}: choose from auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if not base.is_dir():
        return torch.bfloat16
    config = read_config(base)
    return DTYPES.get(str(config.get("torch_dtype") or config.get("dtype")), torch.float32)
