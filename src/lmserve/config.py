"""Engine configuration: one frozen dataclass per subsystem, composed into EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, field


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
