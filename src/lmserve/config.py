"""Engine configuration: one frozen dataclass per subsystem, composed into EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

ENV_API_KEY = "LMSERVE_API_KEY"  # accepted API keys, comma-separated (`lmserve serve`)


@dataclass(frozen=True)
class CacheConfig:
    """KV cache size and layout."""

    block_size: int = 16
    # bytes if > 1, else a fraction of the memory available when the engine starts
    kv_cache_memory: float = 0.15
    num_blocks: int | None = None  # overrides kv_cache_memory (tests use tiny pools)
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine; derived values are resolved by the engine itself."""

    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda[:N]
    quantization: str | None = None  # None (float weights) | int8 | int4: weight-only, applied at load
    max_model_len: int | None = None  # None: the model's context length
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads; None: torch's default
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags of `cli.add_engine_args` (serve, generate, chat and bench share them)."""
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
        max_model_len=args.max_model_len, seed=args.seed,
        num_threads=args.num_threads,
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=not args.no_chunked_prefill),
    )
