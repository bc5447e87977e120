"""KV pool arithmetic: how many blocks a pool gets from its CacheConfig (pure; no tensors, no devices).

Shared by the engine, which builds the pool, and the preflight checks, which refuse a useless pool
before any weights load; one formula, so both agree on the numbers they report.
"""

from __future__ import annotations

from lmserve.config import DEFAULT_KV_CACHE_FRACTION, CacheConfig


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def kv_budget_bytes(cache: CacheConfig, available_bytes: int) -> float:
    """--kv-cache-memory in bytes: given in bytes if > 1, else a fraction of `available_bytes`."""
    size = DEFAULT_KV_CACHE_FRACTION if cache.kv_cache_memory is None else cache.kv_cache_memory
    return size if size > 1 else size * available_bytes


def num_kv_blocks(cache: CacheConfig, block_bytes: int, available_bytes: int, max_num_seqs: int,
                  max_model_len: int, blocks_per_seq: int | None = None) -> int:
    """Blocks in the pool: `num_blocks` if given, else what the budget holds (0 when not even one block fits).

    `blocks_per_seq`: the most blocks one max_model_len request holds over every KV group (cache/kv_groups.
    peak_blocks; None: one group, blocks_for(max_model_len)).
    """
    if cache.num_blocks:
        return cache.num_blocks
    # Never more than the whole context of max_num_seqs sequences: more would sit unused.
    per_seq = blocks_per_seq if blocks_per_seq is not None else blocks_for(max_model_len, cache.block_size)
    cap = max_num_seqs * per_seq
    return min(int(kv_budget_bytes(cache, available_bytes) // block_bytes), cap)


def gpu_kv_budget(total_bytes: int, utilization: float, torch_peak_bytes: int, other_bytes: int) -> int:
    """Bytes for the KV cache on a GPU: its share (`utilization` of the device) less what this process's
    weights and a full step's activations peaked at, and less memory outside torch's allocator (CUDA
    context, other processes); never negative."""
    return max(0, int(utilization * total_bytes) - torch_peak_bytes - other_bytes)
