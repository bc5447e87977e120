"""Checkpoint loading: a path (GGUF file or HF directory) -> a built model with its weights in place."""

from __future__ import annotations

import logging
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, NoReturn

import torch

from lmserve.errors import CheckpointError
from lmserve.layers.linear import can_pack, pack_linears, skinny_coverage
from lmserve.layers.native import native_module
from lmserve.layers.parallel import apply_tensor_parallel, drop_row_biases
from lmserve.layers.quantized import check_scheme, quantize_linears
from lmserve.loader.default_model import default_model_path
from lmserve.loader.gguf_file import FILE_TYPES, GGUFFile, read_gguf
from lmserve.loader.gguf_loader import gguf_config, iter_gguf, rope_freq_factors
from lmserve.loader.gguf_packed import auto_quantization, keep_gguf_quantized
from lmserve.loader.hf_hub import download_snapshot, looks_like_hub_id
from lmserve.loader.prequant import METHODS as PREQUANT_METHODS
from lmserve.loader.prequant import (
    CheckpointTensors,
    PrequantScheme,
    auto_prequant,
    dequantized_rest,
    keep_half_tables,
    keep_prequantized,
    read_scheme,
)
from lmserve.loader.repack_cache import cached_keep
from lmserve.loader.safetensors_loader import iter_safetensors, read_config, weight_files
from lmserve.loader.sharding import TPShard, local_config, split_dim, take_shard
from lmserve.models.config import ModelConfig
from lmserve.models.config_hf import config_from_hf
from lmserve.models.registry import build_model, family_of
from lmserve.models.rope import rope_specs

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "LoadedModel", "default_model_path", "load_model", "read_model_config",
           "resolve_model_path"]


@dataclass
class LoadedModel:
    """A ready model plus what was learned while loading it."""

    model: torch.nn.Module
    config: ModelConfig
    path: Path
    format: str  # "gguf" | "safetensors"
    load_seconds: float
    peak_rss_gib: float
    gguf: GGUFFile | None = None  # parsed header, kept for the tokenizer (GGUF only)
    # the weight format chosen at load (--quantization auto resolved): int8 | int4 | gguf, or a pre-quantized
    # checkpoint's method (gptq | awq | compressed-tensors) on the int kernels; None: float weights
    runtime_quantization: str | None = None
    shard: TPShard | None = None  # tensor parallelism: model holds this rank's part (model.config is per rank)
    prequant: PrequantScheme | None = None  # a GPTQ / AWQ / compressed-tensors checkpoint's checked scheme

    @property
    def quantization(self) -> str:
        """The checkpoint's weight format as stored (GGUF file type, e.g. MOSTLY_Q4_1; a pre-quantized checkpoint's
        scheme, e.g. gptq 4-bit g128 sym), or 'none'."""
        if self.prequant is not None:
            return self.prequant.summary
        if self.gguf is None or "general.file_type" not in self.gguf.metadata:
            return "none"
        file_type = self.gguf.metadata["general.file_type"]  # a malformed file may hold any type here
        return FILE_TYPES.get(file_type, "unknown") if type(file_type) is int else "unknown"

    @property
    def weight_format(self) -> str:
        """How the weights are held while serving: gguf | gptq | awq | compressed-tensors (the int kernels' blocks) |
        int8 | int4 | none (float, as `--quantization none`)."""
        return self.runtime_quantization or "none"

    @property
    def keeps_blocks(self) -> bool:
        """Do the projections run on the native int kernels' blocks (a GGUF file's or a pre-quantized checkpoint's)?"""
        return self.runtime_quantization in ("gguf",) + PREQUANT_METHODS


def resolve_model_path(model: str | Path | None, revision: str | None = None) -> Path:
    """None -> the embedded default; a path that exists -> itself; `org/name` -> its Hugging Face Hub snapshot."""
    if model is None:
        return default_model_path()
    if isinstance(model, str) and looks_like_hub_id(model):
        return download_snapshot(model, revision)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist (pass a .gguf file, a Hugging Face directory "
                                "or a Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct)")
    return path


def read_model_config(path: Path) -> ModelConfig:
    """The model's hyperparameters from its header alone (GGUF metadata or config.json): no weights are read.

    Raises the CheckpointError load_model would, so a bad checkpoint is refused before anything starts.
    """
    if path.is_dir():
        cfg = _config_from_dir(path)
        _scheme_of(path)  # a refused quantization_config fails here too
        weight_files(path)  # a directory without weights fails here, not after the server is up
        return cfg
    if path.suffix.lower() == ".gguf":
        return gguf_config(read_gguf(path))
    _refuse_format(path)


def _refuse_format(path: Path) -> NoReturn:
    if path.suffix.lower() in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
        raise CheckpointError(f"{path}: pickle checkpoints are not loaded (unpickling can run arbitrary code); "
                              "convert the model to safetensors")
    raise CheckpointError(f"{path}: expected a .gguf file or a Hugging Face directory with config.json")


def load_model(model: str | Path | None, dtype: torch.dtype, device: torch.device, pack: bool = True,
               quantization: str | None = None, revision: str | None = None,
               shard: TPShard | None = None, max_model_len: int | None = None) -> LoadedModel:
    """Read config and weights, build the model on `device` in `dtype`, and log time and peak memory.

    `pack` applies the fast CPU weight format (layers/linear.py); False keeps plain nn.Linear.
    `quantization`: None or "none" keeps float weights; "int8" | "int4" stores linear weights weight-only
    quantized (layers/quantized.py); "gguf" keeps a GGUF file's blocks (loader/gguf_packed.py); "auto" is
    "gguf" where that runs (`auto_quantization`), else "none".
    `revision` picks the Hub revision when `model` is a Hub id.
    `shard` loads only this tensor-parallel rank's part and wraps the row-parallel layers (layers/parallel.py;
    the caller has joined the process group). `config` stays the whole model's; `model.config` is the rank's.
    `max_model_len`, the context the engine will serve, picks LongRoPE's factors (models/rope.py).
    """
    if quantization:
        check_scheme(quantization, device)
    quantization = None if quantization == "none" else quantization
    path = resolve_model_path(model, revision)
    if device.type == "cpu":  # the native kernels first: a fallback compile is logged and timed apart from the load
        native_module()
    start = time.perf_counter()
    world = shard.world_size if shard is not None else 1
    gguf = read_gguf(path) if path.suffix.lower() == ".gguf" and not path.is_dir() else None
    prequant = _scheme_of(path) if path.is_dir() else None
    if quantization == "auto":
        quantization, why = (auto_quantization(gguf, device, dtype, world) if prequant is None
                             else auto_prequant(prequant, device, dtype, world))
        log.info("--quantization auto: %s (%s)", quantization or "none", why)
    if path.is_dir():
        if quantization == "gguf":
            raise CheckpointError(f"{path}: --quantization gguf keeps a GGUF file's quantized blocks; this is "
                                  "a safetensors checkpoint (use auto, int8 or int4)")
        cfg = replace(_config_from_dir(path), max_model_len=max_model_len)
        files, weight_map = weight_files(path)
        if prequant is not None:
            net = _load_prequantized(files, prequant, cfg, dtype, device, shard, keep=quantization == prequant.method)
        else:
            net = _empty_model(local_config(cfg, world), dtype, device)
            net.load_weights(_family_tensors(iter_safetensors(files, weight_map, shard), cfg, shard))
    elif gguf is not None:
        cfg = replace(gguf_config(gguf), max_model_len=max_model_len)
        net = _load_gguf(gguf, cfg, dtype, device, shard, keep=quantization == "gguf")
    else:
        _refuse_format(path)
    net.eval()
    if world > 1:
        drop_row_biases(net, shard.rank)
    _weight_format(net, quantization, device, dtype, pack)
    if world > 1:
        apply_tensor_parallel(net)
    if gguf is not None:
        gguf.release_pages()  # every weight is a copy by now
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    fmt = "safetensors" if gguf is None else "gguf"
    log.info("loaded %s (%s, %s%s) in %.2f s, %.2f GiB peak RSS", path.name, fmt, str(dtype).removeprefix("torch."),
             f", {quantization} weights" if quantization else "", seconds, rss)
    return LoadedModel(net, cfg, path, fmt, seconds, rss, gguf, quantization, shard, prequant)


def _scheme_of(path: Path) -> PrequantScheme | None:
    """A directory's checked quantization_config (None: float weights), refusals naming config.json."""
    try:
        return read_scheme(read_config(path))
    except CheckpointError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None


def _load_prequantized(files: list[Path], scheme: PrequantScheme, cfg: ModelConfig, dtype: torch.dtype,
                       device: torch.device, shard: TPShard | None, keep: bool) -> torch.nn.Module:
    """Build and fill the model from a pre-quantized checkpoint; `keep`: layers that fit stay in int kernel blocks."""
    tensors = CheckpointTensors(files)
    consumed: set[str] = set()

    def keep_blocks(net: torch.nn.Module) -> None:  # before anything is written: no float copy of a kept layer
        consumed.update(keep_prequantized(net, tensors, scheme))

    def renamed(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, str]]:  # the family's names for it
        return _family_tensors(iter([(name, t, "")]), cfg, None)

    world = shard.world_size if shard is not None else 1
    net = _empty_model(local_config(cfg, world), dtype, device, keep_blocks if keep else None)
    if keep and device.type == "cpu" and dtype == torch.float32:  # after net.to(dtype), which would widen them
        consumed.update(keep_half_tables(net, tensors, renamed))
    net.load_weights(_family_tensors(dequantized_rest(tensors, scheme, consumed, shard), cfg, shard))
    return net


def _load_gguf(gguf: GGUFFile, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               shard: TPShard | None, keep: bool) -> torch.nn.Module:
    """Build and fill the model from a GGUF file; `keep`: its quantized tensors stay in their blocks."""
    if keep and shard is not None and shard.world_size > 1:
        raise CheckpointError("--quantization gguf does not split across tensor-parallel ranks yet; "
                              "use --quantization none (the ranks then dequantize the file) or one rank")
    world = shard.world_size if shard is not None else 1
    kept: set[str] = set()

    def keep_blocks(net: torch.nn.Module) -> None:  # on the meta device: the kept tensors are never made float
        # the repacked layers of an earlier start of this file, mapped, where the weight cache has them
        kept.update(cached_keep(net, gguf, dtype, lambda n: keep_gguf_quantized(n, gguf, cfg, dtype)))

    net = _empty_model(local_config(cfg, world), dtype, device, keep_blocks if keep else None)
    factors = rope_freq_factors(gguf)
    if factors is not None:
        net.rotary.reset(rope_specs(net.config, factors), device)
    weights = iter_gguf(gguf, cfg, skip=kept)  # dequantized whole (Q/K unpermuted with the whole head count)
    net.load_weights(_family_tensors(weights, cfg, shard, whole=True))
    return net


# A headless checkpoint (the base model alone, as sentence-transformers and embedding models such as
# Qwen3-Embedding save it: `layers.0...`, `embed_tokens.weight`, `norm.weight`, no LM head) names its tensors
# without the causal LM's `model.` prefix; with tied embeddings it loads whole.
_HEADLESS = ("layers.", "embed_tokens.", "norm.")


def _family_tensors(weights: Iterator[tuple[str, torch.Tensor, str]], cfg: ModelConfig, shard: TPShard | None,
                    whole: bool = False) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Checkpoint tensors as the family's hook gives them (renamed, fused ones split: models/<family>.py), each cut
    to this rank's part where it came whole (`whole`: every tensor; else the parts of a fused tensor, which the
    safetensors reader could not slice by its name)."""
    family = family_of(cfg)
    hook = family.checkpoint_tensors
    split = shard is not None and shard.world_size > 1
    for name, tensor, source in family.checkpoint_stream(weights, cfg):
        name = "model." + name if name.startswith(_HEADLESS) else name
        for new, part in hook(name, tensor, cfg):
            cut = split and (whole or (split_dim(name) is None and new != name))
            yield new, take_shard(new, part, shard) if cut else part, source


def _weight_format(net: torch.nn.Module, quantization: str | None, device: torch.device, dtype: torch.dtype,
                   pack: bool) -> None:
    """The one weight-format transform over the filled model (the GGUF blocks were kept while it was built)."""
    if quantization in ("int8", "int4"):
        quantize_linears(net, quantization)
    elif pack and can_pack(device, dtype):
        pack_linears(net)  # with gguf: the layers that stayed float (F32/F16 tensors)
        if quantization is None:
            _log_skinny_coverage(net)


def _log_skinny_coverage(net: torch.nn.Module) -> None:
    """One line for the whole model instead of one per layer that failed the bit-identity check."""
    used, checked = skinny_coverage(net)
    if checked == 0:  # no native kernels, or weights that are not float32: nothing was checked
        return
    kept = f"; {checked - used} keep oneDNN (not bit-identical)" if used < checked else ""
    log.info("skinny kernel: %d of %d layers use it%s", used, checked, kept)


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "zeros_", "ones_", "constant_")


@contextmanager
def _skip_init() -> Iterator[None]:
    """nn.init's initialisers leave tensors as they are (empty: untouched pages) while a model is built."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)

def _config_from_dir(path: Path) -> ModelConfig:
    raw = read_config(path)  # its errors name the file already
    try:
        return config_from_hf(raw)
    except CheckpointError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 transform: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """Allocate parameters without initialising them (the checkpoint overwrites every one).

    `transform` runs before anything is written (swapping layers for ones that hold real tensors already,
    e.g. GGUF blocks). On the CPU the model is built in place with nn.init skipped, not on the meta
    device: an op on a meta tensor (an initialiser, the rotary frequencies) imports torch._dynamo and
    triton, 153 MiB of RSS a CPU server never uses; the layers a transform replaces were never written,
    so their pages were never committed. Elsewhere it is built on the meta device and only what is
    still there afterwards is allocated.
    """
    if device.type == "cpu":
        with _skip_init():
            net = build_model(cfg)
        if transform is not None:
            transform(net)
        net = net.to(dtype)  # in place: tied parameters stay one
    else:
        with torch.device("meta"):
            net = build_model(cfg)
        if transform is not None:
            transform(net)
        _materialize(net, dtype, device)
    # Buffers are not checkpoint tensors: recompute them on the real device, kept in float32.
    net.rotary.reset(rope_specs(cfg), device)
    return net


def _materialize(net: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter and buffer by an uninitialised one on `device` (floats in `dtype`).

    One new tensor per meta tensor, so a tied embedding and LM head stay one Parameter.
    """
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor) -> (it, kept alive; its new tensor)

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            made[id(t)] = t, new
        return made[id(t)][1]

    for module in net.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.is_meta:
                module._parameters[name] = real(p)
        for name, b in module.named_buffers(recurse=False):
            if b.is_meta:
                module._buffers[name] = real(b)
