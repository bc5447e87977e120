"""Building one model replica: the model (this rank's shard), its tokenizer, the KV pool's size, LoRA slots, the
runner and the executor (with tensor parallelism, the worker ranks first, so they load while rank 0 does).

`build_engine(cfg)` returns the parts as one `EngineParts` (the draft proposer of speculative decoding among
them); LLMEngine runs steps over them and EngineFront checks requests against them. Nothing here runs per step.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, replace

import torch

from lmserve.cache.kv_cache_manager import KVCacheManager
from lmserve.cache.sizing import blocks_for, gpu_kv_budget, num_kv_blocks
from lmserve.config import TORCH_FIRST_SPINS, EngineConfig
from lmserve.cpu_dtype import auto_dtype_why, resolve_dtype
from lmserve.engine.speculate import Proposer, make_proposer
from lmserve.errors import ConfigError
from lmserve.layers.attention.backends import resolve_attention_backend
from lmserve.layers.attention.kv_quant import check_head_dim
from lmserve.layers.formats.pipeline import PPStage
from lmserve.loader import LoadedModel, load_model, read_model_config, resolve_model_path
from lmserve.loader.gguf_packed import KEPT_ENCODERS
from lmserve.loader.pooling import pooler_config
from lmserve.loader.sharding import TPShard
from lmserve.lora.peft_adapter import AdapterError
from lmserve.lora.registry import LoraRegistry
from lmserve.lora.slots import LoraSlots
from lmserve.pooling_params import PoolerConfig
from lmserve.preflight import (
    check_encoder_kv,
    check_kv_pool,
    check_pipeline_parallel,
    check_tensor_parallel,
    kv_pool_shape,
)
from lmserve.tokenizer import Tokenizer, load_tokenizer
from lmserve.utils import available_memory, keep_freed_memory, keeps_gguf, resolve_device, resolve_kv_dtype
from lmserve.worker.executor import MultiprocExecutor, RankProcesses, UniProcExecutor
from lmserve.worker.model_runner import ModelRunner, profile_forward
from lmserve.worker.pooler import token_pair_head
from lmserve.worker.transforms import TransformContext, apply_transforms

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What one replica is made of, built once."""

    cfg: EngineConfig
    device: torch.device
    dtype: torch.dtype  # the model's parameters
    kv_dtype: torch.dtype
    loaded: LoadedModel  # this rank's model (tensor parallelism: its shard)
    tokenizer: Tokenizer
    max_model_len: int  # --max-model-len within the model's context
    eos_token_ids: frozenset[int]  # the tokenizer's and the model config's
    block_size: int
    num_blocks: int
    block_bytes: int  # K and V of one block in every layer, on this rank
    kv: KVCacheManager
    lora_slots: LoraSlots | None  # None: LoRA off
    loras: LoraRegistry | None
    runner: ModelRunner
    executor: UniProcExecutor | MultiprocExecutor
    proposer: Proposer | None = None  # the draft source (None: speculative decoding off)
    pooler: PoolerConfig = PoolerConfig()  # how embedding requests pool (checkpoint files or --pooling)


def build_engine(cfg: EngineConfig, loaded: LoadedModel | None = None,
                 tokenizer: Tokenizer | None = None) -> EngineParts:
    """Load the model named by cfg, or reuse `loaded` (and `tokenizer`) to build engines of other shapes."""
    world = cfg.parallel.world_size
    if cfg.num_threads or world > 1:
        torch.set_num_threads(_threads_per_rank(cfg))
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        _warn_spinning_threads()
    # the header alone, read once here: a decoder's or a KEPT_ENCODERS file's blocks are kept (the dtype below: float32
    # where they are), ranks' splits checked
    header = loaded.config if loaded else read_model_config(resolve_model_path(cfg.model, cfg.revision))
    kept_gguf = keeps_gguf(cfg.model, cfg.quantization, device,
                           header.encoder and header.architecture not in KEPT_ENCODERS)
    dtype = resolve_dtype(cfg.dtype, device, kept_gguf)
    if cfg.dtype == "auto":
        log.info("--dtype auto: %s (%s)", str(dtype).removeprefix("torch."),
                 auto_dtype_why(device, kept_gguf=kept_gguf)[1])
    ranks = None
    if world > 1 and loaded is None:  # check the model splits, then start ranks 1..N-1
        check_tensor_parallel(cfg.parallel, header, device)
        check_pipeline_parallel(cfg.parallel, header, device, cfg.cache.sized_explicitly)
        ranks = RankProcesses(cfg, dtype, device, _threads_per_rank(cfg))  # they load their shards as rank 0 does
    try:
        parts = _build(cfg, device, dtype, loaded, tokenizer, ranks, header.num_layers)
        parts.proposer = make_proposer(cfg, parts.tokenizer, parts.loaded.config.vocab_size, parts.num_blocks,
                                       parts.block_size, parts.dtype, device)
    except BaseException:  # the worker ranks must not outlive an engine that failed to start
        if ranks is not None:
            ranks.stop()
        raise
    if device.type == "cpu":  # after every weight (a draft model's too) is loaded
        keep_freed_memory()
    if parts.loaded.config.encoder:
        log.info("KV cache: none (an encoder keeps no KV between steps; %d blocks of %d tokens account for one "
                 "step's inputs), max_model_len %d", parts.num_blocks, parts.block_size, parts.max_model_len)
    else:
        log.info("KV cache: %d blocks of %d tokens (%s, %.2f GiB%s), max_model_len %d", parts.num_blocks,
                 parts.block_size, str(parts.kv_dtype).removeprefix("torch."),
                 parts.num_blocks * parts.block_bytes / 2**30, " per rank" if ranks else "", parts.max_model_len)
    return parts


def _build(cfg: EngineConfig, device: torch.device, dtype: torch.dtype, loaded: LoadedModel | None,
           tokenizer: Tokenizer | None, ranks: RankProcesses | None, num_layers: int) -> EngineParts:
    """(This rank's part of) the model, then the tokenizer, KV pool, LoRA slots, runner and executor."""
    tp, pp = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    shard = TPShard(0, tp) if ranks is not None and tp > 1 else None
    stage = PPStage(0, pp, num_layers, 0, tp, cfg.parallel.micro_batches_on(device.type)) \
        if ranks is not None and pp > 1 else None
    loaded = loaded or load_model(cfg.model, dtype, device, quantization=cfg.quantization, revision=cfg.revision,
                                  shard=shard, max_model_len=cfg.max_model_len, stage=stage, mmproj=cfg.mmproj,
                                  encoder_dtype=cfg.mm_encoder_dtype)
    load_dtype, dtype = dtype, next(loaded.model.parameters()).dtype  # asked for; the model's (a kept GGUF: float32)
    kv_dtype = _kv_dtype(cfg, dtype, loaded, device)
    backend = resolve_attention_backend(cfg.attention_backend, device, dtype)
    # the model's one transform pipeline (worker/transforms.py): weight format, tensor parallelism, LoRA, MoE kernels,
    # decode stack, warm-up; the KV pool below is sized (on CUDA: profiled) against the model that will serve
    done = apply_transforms(TransformContext(loaded, device, load_dtype, lora=cfg.lora,
                                             triton=backend.name == "triton", kv_dtype=kv_dtype))
    tokenizer = tokenizer or load_tokenizer(loaded)
    if cfg.chat_template is not None:  # serve --chat-template
        tokenizer.chat_template = cfg.chat_template
    model_cfg = loaded.config
    pooler = pooler_config(loaded.path, cfg.pooling, model_cfg.encoder, model_cfg.num_labels,
                           loaded.gguf.metadata if loaded.gguf is not None else None)
    if cfg.classifier_from_token is not None:
        pooler = _token_pair_reranker(cfg, loaded, tokenizer, dtype)
    max_model_len = min(cfg.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)
    if model_cfg.encoder:
        check_encoder_kv(cfg)
        max_model_len = min(max_model_len, pooler.max_seq_length or max_model_len)
        cfg = _encoder_config(cfg, max_model_len)
        _set_separator(loaded, tokenizer)
    block_size = cfg.cache.block_size
    # which layers share a block table, and a block's bytes in one group's layers of this rank's KV heads
    groups, block_bytes, per_seq = kv_pool_shape(loaded.model.config, cfg, kv_dtype, max_model_len)
    if model_cfg.encoder:
        # nothing is kept between steps (models/bert.py attends within the step's tokens): the pool is the block
        # accounting of one step's prompts, in every KV group (ModernBERT's windowed layers make several; each
        # request takes its blocks in each). Sized to the memory budget, it held nothing and took it all: on CUDA the
        # whole profiled budget, zeroed, beside a chat model on the same GPU. --kv-cache-memory does not apply.
        step = blocks_for(cfg.scheduler.max_num_batched_tokens, block_size) + cfg.scheduler.max_num_seqs
        num_blocks = step * len(groups)
        if cfg.cache.sized_explicitly:
            log.info("--kv-cache-memory / --num-kv-blocks: not used by an encoder, which keeps no KV between steps")
    else:
        num_blocks = _num_blocks(cfg, device, loaded, block_bytes, max_model_len, per_seq)
    loras = _lora_registry(cfg, done)
    log.info("pooling: %s (%s)%s; tasks: %s", pooler.method, pooler.source,
             f", {pooler.num_labels} label(s)" if pooler.num_labels else "", ", ".join(pooler.tasks))
    # worth a line where there is a choice to see (CUDA, or a backend asked for); the CPU default is quiet
    say = log.info if device.type == "cuda" or cfg.attention_backend != "auto" else log.debug
    say("attention backend: %s (%s)", backend.name, backend.why)
    # the runner sees this rank's model: its KV cache holds only this rank's KV heads
    # an encoder's model never reads or writes a KV cache: its runner holds none (the scratch block alone), where the
    # pool's blocks, above, are only the scheduler's accounting
    runner = ModelRunner(loaded.model, loaded.model.config, 0 if model_cfg.encoder else num_blocks, block_size, dtype,
                         device, done,
                         kv_dtype=kv_dtype, attention_backend=backend.name, kv_groups=[g.layers for g in groups],
                         pooler=pooler)
    lora_slots = done.lora_slots
    # a captured graph replays fixed weights and inputs: the per-step adapter rows of LoRA are not among them
    # nor a pipeline rank's sends and receives; an encoder has no decode steps to replay (each step is whole prompts,
    # whose sequence bounds its forward reads on the host)
    if (cfg.cuda_graphs and not cfg.enforce_eager and device.type == "cuda" and lora_slots is None and stage is None
            and not model_cfg.encoder):
        runner.enable_decode_graphs(cfg.scheduler.max_num_seqs, blocks_for(max_model_len, block_size), capture=True)
    if ranks is None:
        executor = UniProcExecutor(runner)
    else:
        ranks.send_pool(num_blocks, block_size, [g.layers for g in groups], cfg.parallel.rank_timeout_s * 10)
        executor = MultiprocExecutor(runner, ranks)
    eos = frozenset(tokenizer.eos_token_ids) | frozenset(model_cfg.eos_token_ids)
    kv = KVCacheManager(num_blocks, block_size, cfg.cache.enable_prefix_caching, groups,
                        cfg.scheduler.max_num_batched_tokens)
    return EngineParts(cfg, device, dtype, kv_dtype, loaded, tokenizer, max_model_len, eos, block_size, num_blocks,
                       block_bytes, kv, lora_slots, loras, runner, executor, pooler=pooler)


@functools.cache
def _warn_spinning_threads() -> None:
    """Once a process: torch's OpenMP threads spin between operations here (config.TORCH_FIRST_SPINS). On a 2-core
    Zen 4 that made a decode step 1.2-1.6x slower (benchmarks/moe_decode.py, lora.py, which imported torch first)."""
    if TORCH_FIRST_SPINS:
        log.warning("torch was imported before lmserve, so torch's OpenMP threads spin between operations and take "
                    "CPU time from the model's kernels (decode steps measured 1.2-1.6x slower on 2 cores): import "
                    "lmserve before torch, or set OMP_WAIT_POLICY=PASSIVE")


def _encoder_config(cfg: EngineConfig, max_model_len: int) -> EngineConfig:
    """An encoder's prompts run whole, each in one step (models/bert.py attends within the step's tokens): no
    chunked prefill, a step budget that holds the longest prompt, and no prefix reuse (no KV is kept)."""
    sched = replace(cfg.scheduler, enable_chunked_prefill=False,
                    max_num_batched_tokens=max(cfg.scheduler.max_num_batched_tokens, max_model_len))
    return replace(cfg, scheduler=sched, cache=replace(cfg.cache, enable_prefix_caching=False))


def _token_pair_reranker(cfg: EngineConfig, loaded: LoadedModel, tokenizer: Tokenizer,
                         dtype: torch.dtype) -> PoolerConfig:
    """--classifier-from-token FALSE,TRUE: the decoder's last token pooled, scored by its two tokens' logits (the
    model's `score`, read by the runner's Pooler); each must be one token of the vocabulary."""
    if loaded.config.encoder:
        raise ConfigError("--classifier-from-token is for a decoder; an encoder scores with its own head")
    if cfg.parallel.tensor_parallel_size > 1:
        raise ConfigError("--classifier-from-token needs --tensor-parallel-size 1")
    false_tok, true_tok = cfg.classifier_from_token
    ids = [tokenizer.token_to_id(t) for t in (false_tok, true_tok)]
    if None in ids:
        missing = [t for t, i in zip((false_tok, true_tok), ids) if i is None]
        raise ConfigError(f"--classifier-from-token: {missing} not one token of the model's vocabulary")
    loaded.model.score = token_pair_head(loaded.model.compute_logits, ids[0], ids[1], dtype)
    return PoolerConfig("last", "--classifier-from-token", False, False, 1, labels=(true_tok,))


def _set_separator(loaded: LoadedModel, tokenizer: Tokenizer) -> None:
    """The token that starts a pair's second segment (BERT's token types), from the tokenizer where config.json
    names none."""
    if loaded.model.sep_token_id is None:
        sep = tokenizer.special_tokens.get("sep_token") or tokenizer.eos_token
        loaded.model.sep_token_id = tokenizer.token_to_id(sep) if sep else None


def _threads_per_rank(cfg: EngineConfig) -> int:
    """--num-threads, else the cores shared out between the ranks (2 cores, TP=2: one thread each)."""
    if cfg.num_threads:
        return cfg.num_threads
    return max(1, len(os.sched_getaffinity(0)) // cfg.parallel.world_size)


def _kv_dtype(cfg: EngineConfig, dtype: torch.dtype, loaded: LoadedModel, device: torch.device) -> torch.dtype:
    try:
        kv_dtype = resolve_kv_dtype(cfg.cache.kv_cache_dtype, dtype, loaded.keeps_blocks, device)
        check_head_dim(loaded.model.config.head_dim, kv_dtype)
    except ValueError as e:
        raise ConfigError(f"--kv-cache-dtype {cfg.cache.kv_cache_dtype}: {e}") from None
    return kv_dtype


def _lora_registry(cfg: EngineConfig, done: TransformContext) -> LoraRegistry | None:
    """With cfg.lora: register the adapters named at start (the pipeline's lora step made the device slots)."""
    c = cfg.lora
    if c is None:
        return None
    slots = done.lora_slots
    registry = LoraRegistry(c, done.loaded.config, slots.lora_dtype)
    for name, path in c.modules:
        try:  # preflight read them against the model; only the slots' type (--lora-dtype) is new here
            registry.register(name, path)
        except AdapterError as e:
            raise ConfigError(f"--lora-modules {name}: {e}") from None
    log.info("LoRA: %d adapter(s) at start, %d device slots of %.1f MiB (rank up to %d, %s), %d kept in host memory",
             len(c.modules), c.max_loras, slots.bytes_per_slot / 2**20, c.max_lora_rank,
             str(slots.lora_dtype).removeprefix("torch."), c.max_cpu_loras)
    return registry


def _num_blocks(cfg: EngineConfig, device: torch.device, loaded: LoadedModel, block_bytes: int,
                max_model_len: int, per_seq: int) -> int:
    """The KV pool's size in blocks: as given, or what the memory budget holds."""
    c = cfg.cache
    if device.type == "cuda" and not c.sized_explicitly:
        c = replace(c, kv_cache_memory=_profiled_gpu_budget(cfg, loaded, device))
    available = available_memory(device)
    # what one block costs the memory the pool is sized against: on CPU every rank's share of it comes out of the
    # same host memory; on CUDA each rank has its own GPU
    sizing_bytes = block_bytes * (cfg.parallel.tensor_parallel_size if device.type == "cpu" else 1)
    blocks = num_kv_blocks(c, sizing_bytes, available, cfg.scheduler.max_num_seqs, max_model_len, per_seq)
    if not cfg.cache.sized_explicitly:  # an explicit size was the user's choice (preflight warned about it)
        check_kv_pool(c, blocks, sizing_bytes, max_model_len, available, explicit=False, need=per_seq)
    return max(1, blocks)


def _profiled_gpu_budget(cfg: EngineConfig, loaded: LoadedModel, device: torch.device) -> int:
    """KV bytes under --gpu-memory-utilization: run one full step's worth of tokens and see what it peaks at."""
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward(loaded.model, cfg.scheduler.max_num_batched_tokens, device)
    free, total = torch.cuda.mem_get_info(device)
    other = (total - free) - torch.cuda.memory_reserved(device)  # CUDA context, other processes
    budget = gpu_kv_budget(total, cfg.cache.gpu_memory_utilization, torch.cuda.max_memory_allocated(device), other)
    log.info("GPU memory: %.2f GiB total, %.2f GiB peak in this process's steps, %.2f GiB for the KV cache",
             total / 2**30, torch.cuda.max_memory_allocated(device) / 2**30, budget / 2**30)
    return max(budget, 2)  # (kv_cache_memory <= 1 would read as a fraction) no block fits: check_kv_pool says so
