"""GGUF files (llama.cpp): hyperparameters from metadata, tensors dequantized (vectorised) to float.

Tensor names follow llama.cpp's Llama names below; a family's own (models/<family>.py `gguf_names`) take
precedence, and its `checkpoint_tensors` hook then sees HF names as from a safetensors checkpoint.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Collection, Iterator

import numpy as np
import torch

from lmserve.errors import CheckpointError
from lmserve.loader.gguf_file import GGUFFile, GGUFTensor, type_name
from lmserve.models.config import ModelConfig
from lmserve.models.config_gguf import config_from_gguf
from lmserve.models.registry import family_of

# GGUF tensor name -> HF name ({i} = layer index).
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    # mixture of experts (layers/blocks/moe.py): the router, the stacked experts [E, rows, cols] (`*`: split per expert
    # by `expert_slices`), Qwen2-MoE's shared expert and its gate
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.*.gate_proj.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.*.up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.*.down_proj.weight",
    "blk.{i}.ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
}
# rope tensors are read into the config (models/rope.py, phi3.py), not loaded as weights
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _patterns(names: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    return [(re.compile("^" + re.escape(g).replace(r"\{i\}", r"(\d+)") + "$"), h) for g, h in names.items()]


def gguf_config(f: GGUFFile) -> ModelConfig:
    """ModelConfig from metadata, cross-checked against the embedding tensor and vocabulary."""
    meta = f.metadata
    arch = meta.get("general.architecture")
    embd = next((t for t in f.tensors if t.name == "token_embd.weight"), None)
    if embd is None or len(embd.shape) != 2:
        raise CheckpointError(f"{f.path}: no 2-D token_embd.weight tensor")
    vocab = int(embd.shape[0])
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, (list, np.ndarray)):
        raise CheckpointError(f"{f.path}: GGUF metadata 'tokenizer.ggml.tokens' must be an array")
    if tokens is not None and len(tokens) != vocab:
        raise CheckpointError(f"{f.path}: tokenizer has {len(tokens)} tokens but token_embd.weight has {vocab} rows")
    tensors = {t.name: t for t in f.tensors}

    def small_tensor(name: str) -> torch.Tensor | None:
        return _dequantize(tensors[name], f.path) if name in tensors else None

    try:
        cfg = config_from_gguf(meta, str(arch), vocab, small_tensor, tensors.keys())
    except CheckpointError as e:
        raise CheckpointError(f"{f.path}: {e}") from None
    has_output = any(t.name == "output.weight" for t in f.tensors)
    return replace(cfg, tie_word_embeddings=not has_output)


def rope_freq_factors(f: GGUFFile) -> torch.Tensor | None:
    """Llama 3.1 GGUFs carry rope scaling as a tensor of per-frequency divisors."""
    t = next((t for t in f.tensors if t.name == "rope_freqs.weight"), None)
    return None if t is None else _dequantize(t, f.path).flatten()


def iter_gguf(f: GGUFFile, cfg: ModelConfig, skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield (hf_name, float32 tensor, file) for every weight but those named in `skip` (GGUF names: tensors
    kept in their quantized blocks), Q/K rows put back in HF order."""
    patterns = _patterns(_NAMES | dict(family_of(cfg).gguf_names))
    for t in f.tensors:
        if t.name in _ROPE_TENSORS or t.name in skip:
            continue
        name = hf_name(t.name, patterns)
        if name is None:
            raise CheckpointError(f"{f.path}: unexpected tensor {t.name!r}")
        for part, tensor in expert_slices(name, _dequantize(t, f.path)):
            yield part, unpermute_qk(part, tensor, cfg), str(f.path)


def expert_slices(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked expert tensor (HF name with `*` for the expert) -> one (name, [rows, cols] or a bias [rows]) per
    expert; else as is."""
    if ".experts.*." not in name:
        yield name, tensor
        return
    if tensor.dim() not in (2, 3):
        raise CheckpointError(f"expert tensor {name!r} has shape {tuple(tensor.shape)}, expected [experts, rows, cols] "
                              "or a bias [experts, rows]")
    for e in range(tensor.shape[0]):
        yield name.replace("*", str(e)), tensor[e]


def hf_name(gguf_name: str, patterns: list[tuple[re.Pattern[str], str]]) -> str | None:
    """The HF name of a GGUF tensor, or None."""
    for pattern, hf in patterns:
        m = pattern.match(gguf_name)
        if m:
            return hf.format(i=m.group(1)) if m.groups() else hf
    return None


def _dequantize(t: GGUFTensor, path: Path) -> torch.Tensor:
    """Raw GGUF bytes -> float32 tensor of HF shape, with the gguf package's vectorised kernels."""
    kind = type_name(t)
    if kind == "F32":
        arr = t.data.view(np.float32)
    elif kind == "F16":
        arr = t.data.view(np.float16).astype(np.float32)
    elif kind == "BF16":
        arr = (t.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = math.prod(t.shape[:-1])
        if t.data.size == 0:  # a zero dimension: nothing to dequantize (a reshape to (0, -1) cannot be made)
            return torch.zeros(t.shape)
        try:
            arr = dequantize(t.data.reshape(rows, -1), GGMLQuantizationType(t.ggml_type))
        except NotImplementedError:
            raise CheckpointError(f"{path}: tensor {t.name!r} has unsupported type {kind}") from None
    arr = arr.reshape(t.shape)
    if not arr.flags.writeable:  # a float32 view straight into the read-only map: copy (they are small)
        arr = arr.copy()
    return torch.from_numpy(arr)


def unpermute_qk(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Undo llama.cpp's Q/K row interleave so rotary halves are laid out as in HF checkpoints (the families whose
    converter interleaves them: those llama.cpp rotates in its "normal" style)."""
    if not family_of(cfg).gguf_permuted_qk:
        return tensor
    if ".q_proj." in name:
        heads = cfg.num_heads
    elif ".k_proj." in name:
        heads = cfg.num_kv_heads
    else:
        return tensor
    rows = tensor.shape[0]
    return (tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:])
            .transpose(1, 2).reshape(tensor.shape))
