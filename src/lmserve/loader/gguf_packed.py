"""`--quantization gguf`: the model's projections, embedding and LM head read the GGUF file's own blocks.

`keep_gguf_quantized` runs on the model while it is still on the meta device, before anything is
allocated: every projection whose GGUF tensors are all of a type layers/formats/gguf_linear.py can repack, in
one kernel layout, is replaced by a GGUFLinear built from the raw blocks in the memory map (fused qkv and
gate_up stack their parts' rows, or take a tensor the file stores fused, as Phi-3's; q and k rows are put in
Hugging Face order as the float path does, llama.cpp interleaves them for some families). A fused
projection whose parts are in different layouts (Q4_K_M files often give v a Q6_K or Q8_0 tensor beside
Q4_K/Q5_0 q and k) becomes a FusedGGUFLinear, one GGUFLinear per run of parts in one layout; the embedding table becomes a GGUFEmbedding (rows dequantized on lookup) and a tied LM head a
GGUFLinear over the same tensors. The loader then allocates and fills only what is left (norms, biases,
tensors of other types such as F32/F16), so no float copy of a kept tensor is ever made.
An encoder's projections (`_keep_encoder`: BERT and XLM-R files' q, k, v, output, up and down; NomicBERT's and
ModernBERT's fused qkv, output, MLP in and out) are kept the same way; its embedding tables stay float. `auto_quantization` decides whether `--quantization auto` (the default) does this.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from lmserve.errors import CheckpointError
from lmserve.layers.formats.gguf_embedding import GGUFEmbedding, share_blocks
from lmserve.layers.formats.gguf_linear import (
    BLOCK_BYTES,
    FusedGGUFLinear,
    GGUFLinear,
    Repacked,
    concat,
    kernel_layout,
    repack,
)
from lmserve.loader.gguf_file import GGUFFile, GGUFTensor, type_name
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
# the same projections where the file stores them fused (Phi-3: attn_qkv; ffn_up holding gate then up)
_FUSED_PARTS = {"self_attn.qkv_proj": (("attn_qkv", "qkv_proj"),), "mlp.gate_up_proj": (("ffn_up", "gate_up_proj"),)}
# a mixture-of-experts layer's projections (layers/blocks/moe.py): experts stacked in one 3-D tensor each, kept one expert
# slice at a time; Qwen2-MoE's shared expert as a dense MLP's (the router stays float: routing is exact)
_EXPERT_PARTS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}
_SHARED_PARTS = {"mlp.shared_expert.gate_up_proj": (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj")),
                 "mlp.shared_expert.down_proj": (("ffn_down_shexp", "down_proj"),)}
_PROJECTIONS = tuple(g for parts in (*_LAYER_PARTS.values(), *_SHARED_PARTS.values()) for g, _ in parts) + \
    ("attn_qkv",) + tuple(g for parts in _EXPERT_PARTS.values() for g in parts)


# An encoder's projections by the file's architecture: each module of `net.blocks[i]` and the GGUF tensors stacked
# into it, in order. "bert" is BERT's and XLM-R's (models/bert.py `EncoderLayer`: separate q, k, v); nomic-bert's
# and modern-bert's are models/rotary_encoder.py's layers: a fused attn_qkv, and NomicBERT's gate_up is fc12 (the
# gate: ffn_gate) then fc11 (ffn_up), as its checkpoint stream stacks them; ModernBERT's ffn_up is its fused Wi
# ([input | gate]) as the file holds it. No rows are reordered: llama.cpp's converter permutes q and k only for
# the decoders whose rotary pairs interleave, and these three are read unpermuted by the float loader too.
_ENCODER_PARTS = {
    "bert": {"qkv": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",), "up": ("ffn_up",),
             "down": ("ffn_down",)},
    "nomic-bert": {"qkv": ("attn_qkv",), "o_proj": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
                   "down": ("ffn_down",)},
    "modern-bert": {"qkv": ("attn_qkv",), "o_proj": ("attn_output",), "up": ("ffn_up",), "down": ("ffn_down",)},
}
KEPT_ENCODERS = tuple(_ENCODER_PARTS)  # the GGUF architectures whose encoder blocks stay quantized


def keepable_types(f: GGUFFile) -> tuple[int, int, set[str]]:
    """(projection weights that can stay quantized, projection weights in all, their kept types); biases, always
    float, are not counted (a BERT file's were: "36 of 72")."""
    proj = [t for t in f.tensors
            if t.name.startswith("blk.") and t.name.endswith(".weight") and t.name.split(".")[-2] in _PROJECTIONS]
    kept = [type_name(t) for t in proj if type_name(t) in BLOCK_BYTES]
    return len(kept), len(proj), set(kept)


def auto_quantization(f: GGUFFile | None, device: torch.device, dtype: torch.dtype, world: int,
                      encoder: bool = False) -> tuple[str | None, str]:
    """`--quantization auto` -> ("gguf" or None, why): keep the file's blocks where the native kernels run them.

    `encoder`: the file is an encoder's (models/bert.py, models/rotary_encoder.py): the blocks of the architectures
    in KEPT_ENCODERS are kept by `_keep_encoder`, another encoder's dequantized to float on load."""
    if f is None:
        return None, "not a GGUF file"
    if encoder and f.metadata.get("general.architecture") not in KEPT_ENCODERS:
        return None, (f"this encoder's projections are dequantized on load; the blocks of {', '.join(KEPT_ENCODERS)} "
                      "files are kept")
    why_not = [what for what, bad in (("device " + str(device), device.type != "cpu"),
                                      ("dtype " + str(dtype).removeprefix("torch."), dtype != torch.float32),
                                      (f"tensor parallel size {world}", world > 1)) if bad]
    if why_not:
        return None, f"GGUF blocks are kept only on CPU, float32, one rank; here: {', '.join(why_not)}"
    kept, total, types = keepable_types(f)
    if kept == 0:
        return None, f"none of the {total} projection tensors is of a type that can stay quantized"
    return "gguf", f"{kept} of {total} projection tensors are {'/'.join(sorted(types))} blocks; CPU, float32"


def keep_gguf_quantized(net: nn.Module, f: GGUFFile, cfg: ModelConfig, dtype: torch.dtype) -> set[str]:
    """Swap `net`'s projections, embedding and LM head for layers over `f`'s blocks; returns the GGUF names kept.

    `net` may be on the meta device: a swapped layer's bias is allocated (on CPU) for the loader to fill.
    """
    tensors = {t.name: t for t in f.tensors}
    if cfg.encoder:
        return _keep_encoder(net, tensors, _ENCODER_PARTS[f.metadata.get("general.architecture")])
    kept: set[str] = set()
    for i, layer in enumerate(net.model.layers):
        if getattr(layer, "absent", False):  # another pipeline rank's (layers/formats/pipeline.py)
            continue
        for path in (*_LAYER_PARTS, *_SHARED_PARTS):
            parts = _parts(tensors, i, path)
            names = [f"blk.{i}.{g}.weight" for g, _ in parts]
            found = [tensors.get(n) for n in names]
            if all(t is not None and type_name(t) in BLOCK_BYTES for t in found):
                hf = [f"model.layers.{i}.{path.rsplit('.', 1)[0]}.{h}.weight" for _, h in parts]
                _swap(layer, path, [_rows(t, h, cfg) for t, h in zip(found, hf)])
                kept.update(names)
        kept |= _keep_experts(layer, tensors, i)
    if not getattr(net.model.embed_tokens, "absent", False):
        kept |= _keep_embedding(net, tensors, cfg, dtype)
    log.info("--quantization gguf: %d GGUF tensors stay in their quantized blocks", len(kept))
    return kept


def _keep_encoder(net: nn.Module, tensors: dict[str, GGUFTensor], parts: dict[str, tuple[str, ...]]) -> set[str]:
    """An encoder's projections (`parts`: its architecture's `_ENCODER_PARTS`) over the file's blocks, in the file's
    row order; its embeddings, norms, biases and any classification head are dequantized as before."""
    kept: set[str] = set()
    for i, block in enumerate(net.blocks):
        for attr, gguf_names in parts.items():
            names = [f"blk.{i}.{g}.weight" for g in gguf_names]
            found = [tensors.get(n) for n in names]
            if all(t is not None and type_name(t) in BLOCK_BYTES and t.shape[1] % 32 == 0 for t in found):
                _replace(block, attr, [repack(type_name(t), t.data, *t.shape) for t in found])
                kept.update(names)
    log.info("--quantization gguf: %d GGUF tensors of the encoder stay in their quantized blocks", len(kept))
    return kept


def _keep_experts(layer: nn.Module, tensors: dict[str, GGUFTensor], i: int) -> set[str]:
    """Layer i's stacked experts as one GGUFLinear per expert and projection, over that expert's slice of the blocks."""
    kept: set[str] = set()
    for attr, gguf_names in _EXPERT_PARTS.items():
        names = [f"blk.{i}.{g}.weight" for g in gguf_names]
        found = [tensors.get(n) for n in names]
        if not all(t is not None and type_name(t) in BLOCK_BYTES for t in found):
            continue
        slices = [_expert_rows(t) for t in found]  # per part: one Repacked per expert
        for e in range(len(slices[0])):
            _swap(layer, f"mlp.experts.{e}.{attr}", [part[e] for part in slices])
        kept.update(names)
    return kept


def _expert_rows(t: GGUFTensor) -> list[Repacked]:
    """A stacked [E, N, K] tensor's blocks repacked, one [N, K] matrix per expert (no expert's rows are permuted)."""
    if len(t.shape) != 3:
        raise CheckpointError(f"{t.name}: expected [experts, rows, cols], got shape {tuple(t.shape)}")
    e, n, k = t.shape
    if k % 32:
        raise CheckpointError(f"{t.name}: {k} columns is not a whole number of quantization blocks")
    w = repack(type_name(t), t.data, e * n, k)
    return [w.rows(np.arange(j * n, (j + 1) * n)) for j in range(e)]


def _parts(tensors: dict[str, GGUFTensor], i: int, path: str) -> tuple[tuple[str, str], ...]:
    """The GGUF tensors (and HF names) of layer i's projection `path`: separate parts, or the file's fused one."""
    fused = _FUSED_PARTS.get(path)
    separate = _LAYER_PARTS.get(path) or _SHARED_PARTS[path]
    if fused is not None and f"blk.{i}.{separate[0][0]}.weight" not in tensors:
        return fused
    return separate


def _keep_embedding(net: nn.Module, tensors: dict[str, GGUFTensor], cfg: ModelConfig, dtype: torch.dtype) -> set[str]:
    """The token table as a GGUFEmbedding, the LM head as a GGUFLinear (a tied head over the table's tensors)."""
    kept = set()
    embd, head = tensors.get("token_embd.weight"), tensors.get("output.weight")
    own_head = head is not None and type_name(head) in BLOCK_BYTES
    if embd is not None and type_name(embd) in BLOCK_BYTES:
        table = _rows(embd, "model.embed_tokens.weight", cfg)
        tied = cfg.tie_word_embeddings and not own_head
        # a tied head's kernel reads the table: held once, in that kernel's layout (lookups gather rows out of it);
        # a table only looked up stays in rows
        net.model.embed_tokens = GGUFEmbedding(kernel_layout(table) if tied else table, dtype)
        kept.add(embd.name)
        if tied:
            net.lm_head = share_blocks(net.model.embed_tokens)
    if own_head:
        net.lm_head = GGUFLinear(_rows(head, "lm_head.weight", cfg), cfg.hidden_size, None)
        kept.add(head.name)
    return kept


def _rows(t: GGUFTensor, hf_name: str, cfg: ModelConfig) -> Repacked:
    """One tensor's blocks repacked, rows in Hugging Face order."""
    n, k = t.shape
    if k % 32:
        raise CheckpointError(f"{t.name}: {k} columns is not a whole number of quantization blocks")
    w = repack(type_name(t), t.data, n, k)
    order = unpermute_qk(hf_name, torch.arange(n)[:, None], cfg)[:, 0].numpy()
    return w if np.array_equal(order, np.arange(n)) else w.rows(order)


def _swap(layer: nn.Module, path: str, parts: list[Repacked]) -> None:
    """Replace the projection at `path` by a GGUFLinear over `parts` (stacked), or a FusedGGUFLinear where their
    layouts differ (one GGUFLinear per run of one layout)."""
    parent_name, attr = path.rsplit(".", 1)
    _replace(layer.get_submodule(parent_name), attr, parts)


def _replace(parent: nn.Module, attr: str, parts: list[Repacked]) -> None:
    """`_swap` for the module `parent.attr`."""
    old = getattr(parent, attr)
    bias = old.bias if isinstance(old, nn.Linear) else None
    if bias is not None and bias.is_meta:  # filled by the loader with the file's bias (Qwen2's q/k/v)
        bias = torch.empty(bias.shape)
    runs: list[list[Repacked]] = []
    for w in parts:
        if runs and runs[-1][0].layout == w.layout:
            runs[-1].append(w)
        else:
            runs.append([w])
    if len(runs) == 1:
        setattr(parent, attr, GGUFLinear(concat(parts), old.in_features, bias))
    else:
        setattr(parent, attr, FusedGGUFLinear([GGUFLinear(concat(r), old.in_features, None) for r in runs], bias))
