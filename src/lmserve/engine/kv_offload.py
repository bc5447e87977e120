"""Wiring the KV tier (cache/kv_tier.py) into an engine: what its blocks are keyed by, the store, the copies."""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Sequence

import torch

from lmserve.cache.kv_groups import KVGroup
from lmserve.cache.kv_tier import KVTier, open_kv_tier
from lmserve.config import VERSION
from lmserve.layers.attention.backends import resolve_attention_backend
from lmserve.layers.kernels.native import build_key
from lmserve.loader.fingerprint import served_fingerprint
from lmserve.preflight import check_kv_offload
from lmserve.worker.kv_transfer import BlockCopier, KVTransfer

if TYPE_CHECKING:
    from lmserve.engine.build import EngineParts

log = logging.getLogger(__name__)


def attach_kv_tier(engine: EngineParts) -> KVTier | None:
    """Build the tier the engine's config asks for (None: off) and hook it to the KV cache manager and the runner."""
    cfg = engine.cfg.kv_offload
    if not cfg.enabled:
        return None
    check_kv_offload(engine.cfg)
    copier = BlockCopier(engine.runner.kv_block_tensors())
    tier = open_kv_tier(cfg, kv_identity(engine, copier.layout()), copier.block_bytes, engine.block_size)
    engine.kv.attach_tier(tier)
    engine.runner.kv_transfer = KVTransfer(copier, tier)
    disk, shared = tier.disk, tier.shared
    log.info("KV tier: host %s, disk %s, shared %s (blocks of %.2f MiB)",
             f"{cfg.memory_bytes / 2**30:.2f} GiB" if tier.host is not None else "off",
             f"{disk.dir} ({disk.stats.files} blocks, {disk.stats.used_bytes / 2**30:.2f} of "
             f"{cfg.disk_bytes / 2**30:.2f} GiB)" if disk is not None else "off",
             _shared_text(shared, cfg) if shared is not None else "off", copier.block_bytes / 2**20)
    return tier


def _shared_text(shared, cfg) -> str:
    """How the shared tier reads in the start-up log: its store and bound."""
    if hasattr(shared, "url"):
        return f"Redis {shared.url} (blocks expire {cfg.shared_ttl_s:.0f} s after their last use)"
    return f"{shared.dir} ({shared.stats.files} blocks, at most {cfg.shared_bytes / 2**30:.2f} GiB from this replica)"


def kv_identity(engine: EngineParts, layout: str) -> dict[str, str]:
    """Everything a KV block's bytes depend on besides its tokens and salt: blocks are found only under the same.

    The weights (fingerprint, format, dtype), the code that computed the KV (lmserve's version, the native kernels'
    build key, torch's version, the attention backend, the device, the thread count), the tokenizer (ids mean the
    same text), and the KV layout (element types and shapes of every block-indexed tensor; the block size; the KV
    groups, whose index is part of each block's key).
    """
    loaded = engine.loaded
    backend = resolve_attention_backend(engine.cfg.attention_backend, engine.device, engine.dtype).name
    device = engine.device.type
    if device == "cuda":
        device += ":" + torch.cuda.get_device_name(engine.device)
    vocab = hashlib.sha256("\0".join(engine.tokenizer.vocab_tokens()).encode("utf-8", "surrogatepass")).hexdigest()
    return {
        "weights": served_fingerprint(loaded), "weight_format": loaded.weight_format,
        "dtype": str(engine.dtype).removeprefix("torch."), "lmserve": VERSION,
        "kernels": build_key() or "torch", "torch": torch.__version__, "attention": backend, "device": device,
        "threads": str(torch.get_num_threads()), "tokenizer": vocab[:16], "kv_layout": layout,
        "block_size": str(engine.block_size), "tensor_parallel": str(engine.cfg.parallel.tensor_parallel_size),
        "kv_groups": kv_groups_text(engine.kv.groups),
    }


def kv_groups_text(groups: Sequence[KVGroup]) -> str:
    """Which layers each KV group holds and their window, in group order: a group key names its group by index."""
    return ";".join(f"{','.join(map(str, g.layers))}@{g.window or 'full'}" for g in groups)
