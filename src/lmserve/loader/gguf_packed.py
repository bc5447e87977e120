"""`--quantization gguf`: the model's linear layers read the GGUF file's own quantized blocks.

A transform over a finished model (as `quantize_linears` is): every projection whose GGUF tensors
are all of a type layers/gguf_linear.py can repack is replaced by a GGUFLinear built from the raw
blocks in the memory map; fused projections (qkv, gate_up) stack their parts' rows, and the rows
of q and k are put in Hugging Face order as the float path does (llama.cpp interleaves them).
The LM head of a tied model reads the embedding table's blocks (Q8_0 in the embedded model), and so does the
embedding lookup (layers/gguf_embedding.py: rows dequantized on lookup, no float32 table).
Tensors of other types (F32, F16) keep the float layer.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from lmserve.errors import CheckpointError
from lmserve.layers.gguf_embedding import GGUFEmbedding
from lmserve.layers.gguf_linear import BLOCK_BYTES, GGUFLinear, Repacked, concat, repack
from lmserve.loader.gguf_file import GGUFFile, GGUFTensor
from lmserve.loader.gguf_loader import unpermute_qk
from lmserve.models.config import ModelConfig

log = logging.getLogger(__name__)

# fused parameter -> (GGUF tensor names of its parts, in row order; the HF name each part has, for q/k order)
_LAYER_PARTS = {
    "self_attn.qkv_proj": (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")),
    "self_attn.o_proj": (("attn_output", "o_proj"),),
    "mlp.gate_up_proj": (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj")),
    "mlp.down_proj": (("ffn_down", "down_proj"),),
}


def type_name(t: GGUFTensor) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(t.ggml_type).name


def keep_gguf_quantized(net: nn.Module, f: GGUFFile, cfg: ModelConfig) -> int:
    """Swap the projections of `net` for GGUFLinear layers over `f`'s blocks; returns how many were swapped."""
    tensors = {t.name: t for t in f.tensors}
    swapped = 0
    for i, layer in enumerate(net.model.layers):
        for path, parts in _LAYER_PARTS.items():
            found = [tensors.get(f"blk.{i}.{g}.weight") for g, _ in parts]
            if all(t is not None and type_name(t) in BLOCK_BYTES for t in found):
                hf = [f"model.layers.{i}.{path.split('.')[0]}.{h}.weight" for _, h in parts]
                swapped += _swap(layer, path, concat([_rows(t, h, cfg) for t, h in zip(found, hf)]))
    head = tensors.get("output.weight") or (tensors.get("token_embd.weight") if cfg.tie_word_embeddings else None)
    if head is not None and type_name(head) in BLOCK_BYTES:
        net.lm_head = GGUFLinear(_rows(head, "lm_head.weight", cfg), cfg.hidden_size, None)
        swapped += 1
    log.info("--quantization gguf: %d linear layers read the file's quantized blocks", swapped)
    _keep_embedding_quantized(net, tensors.get("token_embd.weight"), cfg)
    return swapped


def _keep_embedding_quantized(net: nn.Module, t: GGUFTensor | None, cfg: ModelConfig) -> None:
    """Drop the float32 embedding table for one reading the file's blocks (shared with a tied head's)."""
    if t is None or type_name(t) not in BLOCK_BYTES:
        return
    head = net.lm_head
    if cfg.tie_word_embeddings and isinstance(head, GGUFLinear):
        net.model.embed_tokens = GGUFEmbedding(head.codes, head.scales, head.mins, head.kind, cfg.hidden_size)
    else:
        net.model.embed_tokens = GGUFEmbedding.from_repacked(_rows(t, "model.embed_tokens.weight", cfg),
                                                             cfg.hidden_size)


def _rows(t: GGUFTensor, hf_name: str, cfg: ModelConfig) -> Repacked:
    """One tensor's blocks repacked, rows in Hugging Face order."""
    n, k = t.shape
    if k % 32:
        raise CheckpointError(f"{t.name}: {k} columns is not a whole number of quantization blocks")
    w = repack(type_name(t), t.data, n, k)
    order = unpermute_qk(hf_name, torch.arange(n)[:, None], cfg)[:, 0].numpy()
    return w if np.array_equal(order, np.arange(n)) else w.rows(order)


def _swap(layer: nn.Module, path: str, w: Repacked) -> int:
    parent_name, attr = path.split(".")
    parent = getattr(layer, parent_name)
    old = getattr(parent, attr)
    bias = old.bias if isinstance(old, nn.Linear) else None
    setattr(parent, attr, GGUFLinear(w, old.in_features, bias))
    return 1
