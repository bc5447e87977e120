"""Which part of each checkpoint tensor a tensor-parallel rank loads (Megatron-style splits).

Column-parallel (split the output rows): q, k, v, gate and up projections (weights and biases). A rank
keeps a contiguous run of heads, so with num_heads and num_kv_heads both divisible by the world size,
rank r holds query heads [r*H/N, (r+1)*H/N) and exactly the KV heads they read (GQA groups never
straddle ranks). Its fused qkv_proj is then a smaller Linear holding [q_r; k_r; v_r]: the slice of
each of q, k and v, stacked in the same order as the unsharded fused matrix.
Row-parallel (split the input columns): o and down projections; their biases stay whole (added once,
by rank 0, after the all-reduce: layers/formats/parallel.py). gpt-oss's attention sinks are one logit per query head, so
they split with the heads.
Everything else (embedding, norms, LM head, an MoE layer's router) is replicated, and so is a vision model's whole
tower and projector (_TOWER): every rank encodes the images itself and places the same embeddings, so the text
model's collectives see the same inputs (worker/model_runner.py forward_only); a tower's own q/k/v names split nothing. Experts split like the dense
MLP: every rank holds every expert's slice of the intermediate width (column gate/up with their biases, row down), so
routing needs no communication and each rank's experts see the same tokens; the layer's combined output is
all-reduced once, and each expert's down bias (gpt-oss) is added by rank 0 only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lmserve.models.config import ModelConfig

_COLUMN = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")
_ROW = (".o_proj.weight", ".down_proj.weight")
_HEADS = (".self_attn.sinks",)  # one value per query head: split like q_proj's rows
# a vision tower's and projector's tensors under the names of HF's checkpoints (SigLIP/CLIP towers, Qwen2.5-VL's
# `visual.`, LLaVA's projector, Idefics3's connector) and ours after the families' renames (`vision.`)
_TOWER = ("vision_model.", "vision_tower.", "visual.", "multi_modal_projector.", "connector.", "vision.")


@dataclass(frozen=True)
class TPShard:
    """This process's place among the tensor-parallel ranks."""

    rank: int
    world_size: int


def local_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The per-rank model: its share of the query heads, KV heads and MLP width (hidden size and vocab unchanged)."""
    if world_size == 1:
        return cfg
    moe = cfg.moe_intermediate_size
    return replace(cfg, num_heads=cfg.num_heads // world_size, num_kv_heads=cfg.num_kv_heads // world_size,
                   intermediate_size=cfg.intermediate_size // world_size,
                   moe_intermediate_size=None if moe is None else moe // world_size,
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // world_size)


def split_dim(name: str) -> int | None:
    """The dimension a checkpoint tensor (HF name) is split along: 0 column-parallel, 1 row-parallel, None whole."""
    if name.startswith(_TOWER) or any(f".{t}" in name for t in _TOWER):
        return None
    if any(f in name for f in _COLUMN) or name.endswith(_HEADS):
        return 0
    if any(name.endswith(f) for f in _ROW):
        return 1
    return None


def shard_bounds(name: str, shape: tuple[int, ...], shard: TPShard) -> tuple[int, int, int] | None:
    """(dim, start, length) of this rank's part of the tensor, or None when every rank loads all of it."""
    dim = split_dim(name)
    if dim is None or shard.world_size == 1:
        return None
    length = shape[dim] // shard.world_size
    return dim, shard.rank * length, length


def take_shard(name: str, tensor: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """This rank's part of a whole tensor (GGUF: sliced after dequantization), copied so the whole can be freed."""
    bounds = shard_bounds(name, tuple(tensor.shape), shard)
    if bounds is None:
        return tensor
    return tensor.narrow(*bounds).contiguous().clone()
