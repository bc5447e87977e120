"""load_model: a checkpoint (GGUF file or HF directory) -> a built model with this rank's weights in place, as
the model code defines it. The weight formats that swap its float linears, the tensor-parallel wrappers and the
runner's kernels are transforms of this finished model (worker/transforms.py); only the formats that must be chosen
while it is built stay here (a GGUF file's or a pre-quantized checkpoint's kept blocks: never made float)."""

from __future__ import annotations

import itertools
import logging
import re
import resource
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from lmserve.cpu_dtype import encoder_dtype_why
from lmserve.errors import CheckpointError
from lmserve.layers.formats.parallel import drop_row_biases
from lmserve.layers.formats.pipeline import PPStage, cut_to_stage
from lmserve.layers.formats.quantized import check_scheme
from lmserve.layers.kernels.native import native_module
from lmserve.loader.checkpoint import config_from_dir, scheme_of
from lmserve.loader.empty_model import empty_model
from lmserve.loader.gguf_file import FILE_TYPES, GGUFFile, read_gguf
from lmserve.loader.gguf_loader import gguf_config, iter_gguf, rope_freq_factors
from lmserve.loader.gguf_packed import KEPT_ENCODERS, auto_quantization, keep_gguf_quantized
from lmserve.loader.header import refuse_format, resolve_model_path
from lmserve.loader.mmproj import Mmproj, mmproj_tensors, read_mmproj, vision_model_config
from lmserve.loader.prequant import METHODS as PREQUANT_METHODS
from lmserve.loader.prequant import (
    CheckpointTensors,
    PrequantScheme,
    auto_prequant,
    dequantized_rest,
    keep_half_tables,
    keep_prequantized,
)
from lmserve.loader.repack_cache import cached_keep
from lmserve.loader.safetensors_loader import iter_safetensors, weight_files
from lmserve.loader.sharding import TPShard, local_config, split_dim, take_shard
from lmserve.models.config import ModelConfig
from lmserve.models.registry import family_of
from lmserve.models.rope import rope_specs

# the package's name, as before the loader's logic left loader/__init__.py: the lines people grep for stay the same
log = logging.getLogger("lmserve.loader")


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
    stage: PPStage | None = None  # pipeline parallelism: model holds this rank's layers (layers/formats/pipeline.py)
    mmproj: Mmproj | None = None  # a text GGUF's multimodal projector file (--mmproj): its tower and preprocessing
    encoder_dtype: torch.dtype | None = None  # a vision model's tower and projector (--mm-encoder-dtype); None: no tower

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


def load_model(model: str | Path | None, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None, revision: str | None = None,
               shard: TPShard | None = None, max_model_len: int | None = None,
               stage: PPStage | None = None, mmproj: str | Path | None = None,
               encoder_dtype: str | None = None) -> LoadedModel:
    """Read config and weights, build the model on `device` in `dtype`, and log time and peak memory.

    The model comes back untransformed: float linears stay nn.Linear until the pipeline's weight_format step
    (worker/transforms.py) packs or quantizes them.
    `quantization`: None or "none" keeps float weights; "int8" | "int4" is recorded for the weight_format step
    (layers/formats/quantized.py); "gguf" keeps a GGUF file's blocks while the model is built (loader/gguf_packed.py);
    "auto" is "gguf" where that runs (`auto_quantization`), else "none".
    `revision` picks the Hub revision when `model` is a Hub id.
    `shard` loads only this tensor-parallel rank's part, the row-parallel biases on rank 0 alone (the pipeline's
    tensor_parallel step wraps those layers: layers/formats/parallel.py). `config` stays the whole model's; `model.config`
    is the rank's.
    `stage` builds only this pipeline rank's layers (and, on rank 0, the embedding, final norm and LM head): the
    others are parameter-free stand-ins put in before any weight is read, and their tensors are never read.
    `max_model_len`, the context the engine will serve, picks LongRoPE's factors (models/rope.py).
    `mmproj`: llama.cpp's multimodal projector file beside a text GGUF (loader/mmproj.py): the model is the vision
    family's, its tower's weights read from that file.
    `encoder_dtype`: a --mm-encoder-dtype name for a vision model's tower and projector (`auto` resolved by
    cpu_dtype.py `encoder_dtype_why` and logged); None: they are built in `dtype` as the rest.
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
    prequant = scheme_of(path) if path.is_dir() else None
    if mmproj is not None and gguf is None:
        raise CheckpointError(f"--mmproj goes with a text .gguf file; {path} is not one (a Hugging Face directory "
                              "carries its own vision tower)")
    file_cfg = gguf_config(gguf) if gguf is not None else None
    encoder = file_cfg is not None and file_cfg.encoder
    if quantization == "auto":
        quantization, why = (auto_quantization(gguf, device, dtype, world, encoder) if prequant is None
                             else auto_prequant(prequant, device, dtype, world))
        log.info("--quantization auto: %s (%s)", quantization or "none", why)
    if quantization == "gguf" and encoder and (gguf.metadata.get("general.architecture") not in KEPT_ENCODERS
                                               or dtype != torch.float32):
        raise CheckpointError(f"{path}: --quantization gguf keeps an encoder's blocks in float32 only, and for the "
                              f"{', '.join(KEPT_ENCODERS)} architectures (use auto or none: dequantized on load)")
    if path.is_dir():
        if quantization == "gguf":
            raise CheckpointError(f"{path}: --quantization gguf keeps a GGUF file's quantized blocks; this is "
                                  "a safetensors checkpoint (use auto, int8 or int4)")
        cfg = replace(config_from_dir(path), max_model_len=max_model_len)
        files, weight_map = weight_files(path)
        tower = _tower_dtype(encoder_dtype, cfg, dtype, device)
        if prequant is not None:
            net = _load_prequantized(files, prequant, cfg, dtype, device, shard, keep=quantization == prequant.method,
                                     stage=stage, encoder_dtype=tower)
        else:
            net = empty_model(local_config(cfg, world), dtype, device, _staged(stage, None), tower)
            net.load_weights(_family_tensors(iter_safetensors(files, weight_map, shard), cfg, shard, stage=stage))
    elif gguf is not None:
        cfg = replace(file_cfg, max_model_len=max_model_len)
        if mmproj is not None:
            mm = _check_mmproj(mmproj, cfg, quantization, shard, stage)
            tower = _tower_dtype(encoder_dtype, vision_model_config(cfg, mm), dtype, device)
            net = _load_gguf(gguf, cfg, dtype, device, shard, keep=quantization == "gguf", stage=stage, mmproj=mm,
                             encoder_dtype=tower)
            cfg = vision_model_config(cfg, mm)  # the vision family's (one rank: what the model was built from)
        else:
            tower = None
            net = _load_gguf(gguf, cfg, dtype, device, shard, keep=quantization == "gguf", stage=stage)
    else:
        refuse_format(path)
    net.eval()
    if world > 1:  # a row-parallel layer's bias is added once, after the all-reduce: this rank's weights lack it
        drop_row_biases(net, shard.rank)
    if gguf is not None:
        gguf.release_pages()  # every weight is a copy by now
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    fmt = "safetensors" if gguf is None else "gguf"
    log.info("loaded %s (%s, %s%s) in %.2f s, %.2f GiB peak RSS", path.name, fmt, str(dtype).removeprefix("torch."),
             f", {quantization} weights" if quantization else "", seconds, rss)
    return LoadedModel(net, cfg, path, fmt, seconds, rss, gguf, quantization, shard, prequant, stage,
                       mm if mmproj is not None else None, (tower or dtype) if cfg.vision is not None else None)


def _tower_dtype(name: str | None, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """A vision model's tower dtype from its --mm-encoder-dtype name, logged like --dtype auto; None where the
    model has no tower or no name was given (the tower then is in `dtype`)."""
    if name is None or cfg.vision is None:
        return None
    tower, why = encoder_dtype_why(name, device)
    log.info("--mm-encoder-dtype %s: %s (%s)", name, str(tower).removeprefix("torch."), why)
    return tower


def _check_mmproj(mmproj: str | Path, cfg: ModelConfig, quantization: str | None, shard: TPShard | None,
                  stage: PPStage | None) -> Mmproj:
    """The mmproj file read and checked against the text model, and the settings it is served with."""
    if quantization not in (None, "gguf"):  # int8/int4 would quantize the tower's linears too
        raise CheckpointError(f"--mmproj: --quantization {quantization} is not supported with a projector file yet "
                              "(use gguf, auto or none)")
    if (shard is not None and shard.world_size > 1) or stage is not None:
        raise CheckpointError("--mmproj: tensor and pipeline parallelism are not supported with a projector file yet")
    return read_mmproj(mmproj, cfg)


def _load_prequantized(files: list[Path], scheme: PrequantScheme, cfg: ModelConfig, dtype: torch.dtype,
                       device: torch.device, shard: TPShard | None, keep: bool,
                       stage: PPStage | None = None, encoder_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Build and fill the model from a pre-quantized checkpoint; `keep`: layers that fit stay in int kernel blocks."""
    tensors = CheckpointTensors(files)
    consumed: set[str] = set()

    def keep_blocks(net: torch.nn.Module) -> None:  # before anything is written: no float copy of a kept layer
        consumed.update(keep_prequantized(net, tensors, scheme))

    def renamed(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, str]]:  # the family's names for it
        return _family_tensors(iter([(name, t, "")]), cfg, None)

    world = shard.world_size if shard is not None else 1
    net = empty_model(local_config(cfg, world), dtype, device, _staged(stage, keep_blocks if keep else None),
                      encoder_dtype)
    if keep and device.type == "cpu" and dtype == torch.float32:  # after net.to(dtype), which would widen them
        consumed.update(keep_half_tables(net, tensors, renamed))
    net.load_weights(_family_tensors(dequantized_rest(tensors, scheme, consumed, shard), cfg, shard, stage=stage))
    return net


def _load_gguf(gguf: GGUFFile, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               shard: TPShard | None, keep: bool, stage: PPStage | None = None,
               mmproj: Mmproj | None = None, encoder_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Build and fill the model from a GGUF file; `keep`: its quantized tensors stay in their blocks; `mmproj`: the
    vision family's model, the text GGUF's tensors read as for the text model (`cfg`) and the tower's from the
    projector file."""
    if keep and shard is not None and shard.world_size > 1:
        raise CheckpointError("--quantization gguf does not split across tensor-parallel ranks yet; "
                              "use --quantization none (the ranks then dequantize the file) or one rank")
    world = shard.world_size if shard is not None else 1
    kept: set[str] = set()

    def keep_blocks(net: torch.nn.Module) -> None:  # on the meta device: the kept tensors are never made float
        # the repacked layers of an earlier start of this file, mapped, where the weight cache has them
        # (a pipeline rank's cut model is not what the cache holds: its layers are built here each start)
        def build(n: torch.nn.Module) -> set[str]:
            return keep_gguf_quantized(n, gguf, cfg, dtype)
        kept.update(build(net) if stage is not None else cached_keep(net, gguf, dtype, build))

    built = cfg if mmproj is None else vision_model_config(cfg, mmproj)
    net = empty_model(local_config(built, world), dtype, device, _staged(stage, keep_blocks if keep else None),
                      encoder_dtype)
    factors = rope_freq_factors(gguf)
    if factors is not None:
        net.rotary.reset(rope_specs(net.config, factors), device)
    if stage is not None:  # another rank's blocks are never dequantized
        kept |= {t.name for t in gguf.tensors if not _gguf_held(t.name, stage)}
    weights = iter_gguf(gguf, cfg, skip=kept)  # dequantized whole (Q/K unpermuted with the whole head count)
    if mmproj is not None:
        weights = itertools.chain(weights, mmproj_tensors(mmproj))
    net.load_weights(_family_tensors(weights, built, shard, whole=True, stage=stage))
    return net


# A headless checkpoint (the base model alone, as sentence-transformers and embedding models such as
# Qwen3-Embedding save it: `layers.0...`, `embed_tokens.weight`, `norm.weight`, no LM head) names its tensors
# without the causal LM's `model.` prefix; with tied embeddings it loads whole.
_HEADLESS = ("layers.", "embed_tokens.", "norm.")


def _staged(stage: PPStage | None, then: Callable[[torch.nn.Module], None] | None
            ) -> Callable[[torch.nn.Module], None] | None:
    """empty_model's transform: cut to the pipeline rank's part first (no kept layer is built for another rank)."""
    if stage is None:
        return then

    def cut(net: torch.nn.Module) -> None:
        cut_to_stage(net, stage)
        if then is not None:
            then(net)
    return cut


_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _gguf_held(name: str, stage: PPStage) -> bool:
    """Whether a GGUF tensor is this pipeline rank's (its layers; rank 0: also the embedding, norm and head)."""
    m = _GGUF_BLOCK.match(name)
    if m is not None:
        return int(m.group(1)) in stage.layers
    return stage.rank == 0 or name not in ("token_embd.weight", "output_norm.weight", "output.weight")


def _family_tensors(weights: Iterator[tuple[str, torch.Tensor, str]], cfg: ModelConfig, shard: TPShard | None,
                    whole: bool = False, stage: PPStage | None = None) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Checkpoint tensors as the family's hook gives them (renamed, fused ones split: models/<family>.py), each cut
    to this rank's part where it came whole (`whole`: every tensor; else the parts of a fused tensor, which the
    safetensors reader could not slice by its name)."""
    family = family_of(cfg)
    hook = family.checkpoint_tensors
    split = shard is not None and shard.world_size > 1
    for name, tensor, source in family.checkpoint_stream(weights, cfg):
        name = "model." + name if name.startswith(_HEADLESS) else name
        for new, part in hook(name, tensor, cfg):
            if stage is not None and not stage.holds(new):
                continue
            cut = split and (whole or (split_dim(name) is None and new != name))
            yield new, take_shard(new, part, shard) if cut else part, source
