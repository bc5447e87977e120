"""Checks that need no weights, run before anything loads: each mistake is one ConfigError.

`check_engine_config` resolves the model (a path or a Hub id), reads only its header (GGUF metadata or
config.json), and checks the device, the capacities and the KV pool, so `lmserve serve` refuses a bad
setting before its app opens and `generate`, `chat` and `bench` before the weights load (its first checks,
the ranges and the model's files, need no torch: loader/header.py `check_before_torch`). It returns the config with its derived
values filled in (model: a local path; max_model_len: within the model's context), which the engine then
builds from. Model errors stay CheckpointError (they name the file).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from lmserve.cache.kv_disk import SECRET as KV_TIER_SECRET
from lmserve.cache.kv_groups import KVGroup, engine_groups, peak_blocks
from lmserve.cache.kv_shared import is_redis_url
from lmserve.cache.sizing import blocks_for, kv_budget_bytes, num_kv_blocks
from lmserve.config import CacheConfig, EngineConfig, ParallelConfig
from lmserve.cpu_dtype import resolve_dtype
from lmserve.errors import ConfigError
from lmserve.files import private_dir, read_secret
from lmserve.layers.attention.backends import resolve_attention_backend
from lmserve.layers.attention.kv_quant import check_head_dim
from lmserve.layers.formats.quantized import check_scheme
from lmserve.loader import read_model_config
from lmserve.loader.gguf_packed import KEPT_ENCODERS
from lmserve.loader.header import check_before_torch, model_path
from lmserve.loader.sharding import local_config
from lmserve.lora.peft_adapter import AdapterError, read_peft_adapter
from lmserve.models.config import ModelConfig
from lmserve.tokenizer.tokenizer import check_tokenizer_file
from lmserve.utils import KV_QUANT_DTYPES, available_memory, keeps_gguf, resolve_device, resolve_kv_dtype
from lmserve.worker.model_runner import kv_bytes_per_block

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckedConfig:
    """An EngineConfig that passed the checks, with what was learned from the model's header."""

    config: EngineConfig  # model: a local path; max_model_len: set and within the model's context
    model_config: ModelConfig
    model_path: Path


def check_engine_config(cfg: EngineConfig) -> CheckedConfig:
    """Refuse what cannot work (ConfigError, CheckpointError), warn where a value is capped; see the module doc."""
    cfg = check_before_torch(cfg)  # first: what serve, generate and chat check before importing torch
    path = Path(cfg.model)
    device = _device(cfg.device)
    model_config = read_model_config(path, cfg.mmproj)
    # as engine/build.py decides it: an encoder of a KEPT_ENCODERS architecture keeps its blocks like a decoder
    kept_gguf = keeps_gguf(cfg.model, cfg.quantization, device,
                           model_config.encoder and model_config.architecture not in KEPT_ENCODERS)
    dtype = resolve_dtype(cfg.dtype, device, kept_gguf)
    try:
        kv_dtype = resolve_kv_dtype(cfg.cache.kv_cache_dtype, dtype, kept_gguf, device)
    except ValueError as e:
        raise ConfigError(f"--kv-cache-dtype: {e}") from None
    backend = resolve_attention_backend(cfg.attention_backend, device, dtype)  # `triton` where it cannot run: ConfigError
    if backend.name == "triton" and kv_dtype in KV_QUANT_DTYPES.values():
        raise ConfigError(f"--kv-cache-dtype {cfg.cache.kv_cache_dtype}: the Triton attention kernels read float K/V "
                          "only; use --attention-backend reference")
    if cfg.quantization:
        try:
            check_scheme(cfg.quantization, device)
        except ValueError as e:
            raise ConfigError(f"--quantization: {e}") from None
    try:
        check_head_dim(model_config.head_dim, kv_dtype)
    except ValueError as e:
        raise ConfigError(f"--kv-cache-dtype {cfg.cache.kv_cache_dtype}: {e}") from None
    check_tensor_parallel(cfg.parallel, model_config, device)
    check_pipeline_parallel(cfg.parallel, model_config, device, cfg.cache.sized_explicitly)
    if path.is_dir():
        check_tokenizer_file(path)
    cfg = replace(cfg, model=str(path), max_model_len=_max_model_len(cfg.max_model_len, model_config),
                  speculative=_draft(cfg))
    _check_prefill_budget(cfg)
    _check_adapters(cfg, model_config)
    if model_config.encoder:
        check_encoder_kv(cfg)
    check_kv_offload(cfg)
    if model_config.encoder:  # no KV kept between steps: the engine sizes its pool to one step (engine/build.py)
        return CheckedConfig(cfg, model_config, path)
    # Before the weights load, so a fractional --kv-cache-memory sees more free memory than the engine will;
    # the engine checks its real pool again (check_kv_pool) once it knows it.
    # each rank holds its share of the KV heads: on CUDA in its own GPU, on CPU all in the same host memory
    per_rank = local_config(model_config, cfg.parallel.tensor_parallel_size) if device.type == "cuda" else model_config
    shape = kv_pool_shape(per_rank, cfg, kv_dtype, cfg.max_model_len)
    available = available_memory(device)
    blocks = num_kv_blocks(cfg.cache, shape.block_bytes, available, cfg.scheduler.max_num_seqs, cfg.max_model_len,
                           shape.blocks_per_seq)
    check_kv_pool(cfg.cache, blocks, shape.block_bytes, cfg.max_model_len, available, need=shape.blocks_per_seq)
    return CheckedConfig(cfg, model_config, path)


def check_tensor_parallel(parallel: ParallelConfig, model_config: ModelConfig, device: torch.device) -> None:
    """Refuse a tensor-parallel size the model cannot be split by (whole heads, KV heads and MLP rows per rank)."""
    n = parallel.tensor_parallel_size
    if n < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {n}")
    if n == 1:
        return
    c = model_config
    widths = [("MLP intermediate size", c.intermediate_size)]
    if c.num_experts:  # every expert (and a shared one) splits its width like the dense MLP
        widths += [("experts' intermediate size", c.expert_size),
                   ("shared expert's intermediate size", c.shared_expert_intermediate_size)]
    for what, value in [("attention heads", c.num_heads), ("KV heads", c.num_kv_heads), *widths]:
        if value % n:
            sizes = [d for d in range(2, c.num_kv_heads + 1)
                     if all(v % d == 0 for v in (c.num_heads, c.num_kv_heads, *(w for _, w in widths)))]
            raise ConfigError(f"--tensor-parallel-size {n}: the model's {what} ({value}) are not divisible by {n}, so "
                              f"its layers cannot be split across {n} ranks (sizes that split it: "
                              f"{', '.join(map(str, sizes)) or 'none'}; or 1)")
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise ConfigError(f"--tensor-parallel-size {n} needs {n} GPUs (one per rank); "
                          f"{torch.cuda.device_count()} visible")


def check_pipeline_parallel(parallel: ParallelConfig, model_config: ModelConfig, device: torch.device,
                            sized_explicitly: bool = True) -> None:
    """Refuse a pipeline-parallel size that leaves a stage without a layer, or ranks without a GPU each."""
    n, layers = parallel.pipeline_parallel_size, model_config.num_layers
    if n < 1:
        raise ConfigError(f"--pipeline-parallel-size must be >= 1, got {n}")
    if n == 1:
        return
    if model_config.encoder:  # an encoder's layers are not the causal LM's layer loop
        raise ConfigError(f"--pipeline-parallel-size {n}: encoder models are not split into pipeline stages; use 1")
    if n > layers:
        raise ConfigError(f"--pipeline-parallel-size {n}: the model has {layers} decoder layers, so at most {layers} "
                          "ranks can each hold one")
    world = parallel.world_size  # with --tensor-parallel-size: each stage splits its layers across that many ranks
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ConfigError(f"--pipeline-parallel-size {n} x --tensor-parallel-size {parallel.tensor_parallel_size} "
                          f"needs {world} GPUs (one per rank); {torch.cuda.device_count()} visible")
    if device.type == "cuda" and not sized_explicitly:  # rank 0 alone cannot run the profiling step of the ring
        raise ConfigError(f"--pipeline-parallel-size {n} on CUDA: give the KV cache's size with --num-kv-blocks or "
                          "--kv-cache-memory (the pool is not profiled across pipeline ranks yet)")


def _device(name: str) -> torch.device:
    try:
        return resolve_device(name)
    except (ValueError, RuntimeError) as e:  # torch.device("gpu") is a RuntimeError
        raise ConfigError(f"--device {name}: {e} (choose auto, cpu, cuda or cuda:N)") from None


def _max_model_len(requested: int | None, model_config: ModelConfig) -> int:
    """The context length: the model's unless a shorter one is asked for; a longer one is capped, with a warning."""
    limit = model_config.max_position_embeddings
    if requested is not None and requested > limit:
        log.warning("--max-model-len %d is more than the model's context of %d tokens; using %d",
                    requested, limit, limit)
    return limit if requested is None else min(requested, limit)


def _draft(cfg: EngineConfig):
    """The speculative config with a draft model resolved to a local path and its header checked."""
    spec = cfg.speculative
    if spec is None or spec.model is None:
        return spec
    path = model_path(spec.model, None)
    read_model_config(path)
    return replace(spec, model=str(path))


def _check_prefill_budget(cfg: EngineConfig) -> None:
    s = cfg.scheduler
    if not s.enable_chunked_prefill and s.max_num_batched_tokens < cfg.max_model_len:
        log.warning("--no-chunked-prefill with --max-num-batched-tokens %d < max_model_len %d: a prompt plus "
                    "max_tokens longer than %d tokens will be refused", s.max_num_batched_tokens,
                    cfg.max_model_len, s.max_num_batched_tokens)


class KVPoolShape(NamedTuple):
    """What one KV block is and how many a request needs: the same numbers for the engine and the checks before it."""

    groups: tuple[KVGroup, ...]  # layers that share a block table (cache/kv_groups.py)
    block_bytes: int  # block_size slots in one group's layers (this rank's KV heads)
    blocks_per_seq: int  # the most blocks one max_model_len request holds at once, over every group


def kv_pool_shape(model: ModelConfig, cfg: EngineConfig, kv_dtype: torch.dtype, max_model_len: int) -> KVPoolShape:
    """The KV groups of `model`'s layers, the bytes of a block and the blocks a max_model_len request holds."""
    groups = engine_groups(list(map(model.window, range(model.num_layers))), max_model_len, cfg.cache.hybrid_kv_cache)
    block_bytes = kv_bytes_per_block(model, cfg.cache.block_size, kv_dtype, len(groups[0].layers))
    per_seq = peak_blocks(groups, max_model_len, cfg.cache.block_size, cfg.scheduler.max_num_batched_tokens)
    return KVPoolShape(groups, block_bytes, per_seq)


def check_kv_pool(cache: CacheConfig, num_blocks: int, block_bytes: int, max_model_len: int,
                  available_bytes: int, explicit: bool | None = None, need: int | None = None) -> None:
    """Refuse a pool that cannot hold one max_model_len request, unless its size was given explicitly (then warn).

    A pool without a single block is refused either way: it could serve nothing. `explicit` overrides
    `cache.sized_explicitly` (a GPU budget from profiling is written into the config but was not the user's).
    """
    explicit = cache.sized_explicitly if explicit is None else explicit
    if need is None:  # blocks one max_model_len request holds (over every KV group: cache/kv_groups.peak_blocks)
        need = blocks_for(max_model_len, cache.block_size)
    if num_blocks >= need:
        return
    tokens = num_blocks * cache.block_size
    size = _mib(kv_budget_bytes(cache, available_bytes)) if cache.num_blocks is None else f"{num_blocks} blocks"
    raise_to = f"raise --kv-cache-memory to at least {need * block_bytes} ({_mib(need * block_bytes)})"
    if num_blocks < 1:
        raise ConfigError(f"the KV cache ({size}) holds not even one block of {cache.block_size} tokens "
                          f"({_mib(block_bytes)}): {raise_to}")
    msg = (f"the KV cache ({size}) holds {tokens} tokens, fewer than one request of max_model_len "
           f"{max_model_len}")
    if explicit:
        log.warning("%s: a prompt plus max_tokens longer than %d tokens will be refused", msg, tokens)
        return
    raise ConfigError(f"{msg}: lower --max-model-len to {tokens} or {raise_to} "
                      "(or give the size explicitly with --kv-cache-memory or --num-kv-blocks to accept it)")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{int(n)} bytes"


def check_encoder_kv(cfg: EngineConfig) -> None:
    """An encoder keeps no KV between steps: a KV tier has nothing to hold (the tier's own refusal, after the engine
    turns an encoder's prefix caching off, named --no-prefix-caching, which the user never gave)."""
    if cfg.kv_offload.enabled:
        raise ConfigError("--kv-offload-memory / --kv-offload-dir / --kv-shared keep prefix-cache blocks; an encoder "
                          "keeps no KV between steps, so there is nothing to offload or share")


def check_kv_offload(cfg: EngineConfig) -> None:
    """The KV tier holds prefix-cache blocks of one rank's whole KV: it needs prefix caching, one rank, and
    directories it can write (a shared one's Redis URL must parse; Redis itself may be down: its blocks are misses)."""
    c = cfg.kv_offload
    if not c.enabled:
        return
    flag = "--kv-offload-memory" if c.memory_bytes else "--kv-offload-dir" if c.directory else "--kv-shared"
    if not cfg.cache.enable_prefix_caching:
        raise ConfigError(f"{flag} keeps prefix-cache blocks: it cannot be used with --no-prefix-caching")
    if cfg.parallel.tensor_parallel_size > 1:
        raise ConfigError(f"{flag} does not yet copy the KV of tensor-parallel ranks; use --tensor-parallel-size 1")
    if cfg.parallel.pipeline_parallel_size > 1:
        raise ConfigError(f"{flag} does not yet copy the KV of pipeline ranks; use --pipeline-parallel-size 1")
    if c.directory is not None:
        _check_tier_dir("--kv-offload-dir", c.directory)
    if c.shared is not None and is_redis_url(c.shared):
        _check_redis_url(c.shared)
    elif c.shared is not None:
        _check_tier_dir("--kv-shared", c.shared)


def _check_redis_url(url: str) -> None:
    import redis  # only when asked for

    try:
        redis.Redis.from_url(url).close()
    except ValueError as e:
        raise ConfigError(f"--kv-shared: not a Redis URL ({e})") from None


def _check_tier_dir(flag: str, directory: str) -> None:
    d = Path(directory).expanduser()
    try:  # lmserve's alone: a directory others may write would let them plant or swap block files
        private_dir(d, own=True)
        read_secret(d / KV_TIER_SECRET)  # made now, or refused when others may read it
    except (PermissionError, ValueError) as e:
        raise ConfigError(f"{flag} {directory}: refused: {e.args[0]}") from None
    except OSError as e:
        raise ConfigError(f"{flag} {directory}: cannot write there ({e.strerror})") from None
    try:
        probe = d / f".probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{flag} {directory}: cannot write there ({e.strerror})") from None


def _check_adapters(cfg: EngineConfig, model_config: ModelConfig) -> None:
    """Every --lora-modules adapter reads and fits the base model (its tensors are read again by the engine)."""
    if cfg.lora is None:
        return
    names = [name for name, _ in cfg.lora.modules]
    if len(set(names)) != len(names):
        raise ConfigError(f"--lora-modules: a name appears twice ({', '.join(names)})")
    for name, path in cfg.lora.modules:
        try:
            read_peft_adapter(path, model_config, name=name, max_rank=cfg.lora.max_lora_rank)
        except AdapterError as e:
            raise ConfigError(f"--lora-modules {name}: {e}") from None
