"""GGUF files (llama.cpp): hyperparameters from metadata, tensors dequantized (vectorised) to float."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from lmserve.loader.errors import CheckpointError
from lmserve.models.config import ModelConfig

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
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_PATTERNS = [(re.compile("^" + re.escape(g).replace(r"\{i\}", r"(\d+)") + "$"), h) for g, h in _NAMES.items()]
_BIG_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}


def open_gguf(path: Path) -> Any:
    """Open (memory-map) a GGUF file; any parse failure names the file."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError, IndexError, struct errors... on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """Scalar and small-array metadata as Python values (the tokenizer's big arrays are left out)."""
    meta = {}
    for key, field in reader.fields.items():
        if key in _BIG_ARRAYS:
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # an unreadable optional field is not fatal; required ones are checked later
            continue
    return meta


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    """ModelConfig from metadata, cross-checked against the embedding tensor and vocabulary."""
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens.data) if tokens is not None else None
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise CheckpointError(f"{path}: no token_embd.weight tensor")
    vocab = int(embd.shape[1])
    if n_tokens is not None and n_tokens != vocab:
        raise CheckpointError(f"{path}: tokenizer has {n_tokens} tokens but token_embd.weight has {vocab} rows")
    try:
        cfg = ModelConfig.from_gguf(meta, str(arch), vocab)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return replace(cfg, tie_word_embeddings=not has_output)


def rope_freq_factors(reader: Any) -> torch.Tensor | None:
    """Llama 3.1 GGUFs carry rope scaling as a tensor of per-frequency divisors."""
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if t is None else torch.from_numpy(np.array(t.data, dtype=np.float32)).flatten()


def iter_gguf(reader: Any, cfg: ModelConfig, path: Path) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield (hf_name, float32 tensor, file) for every weight, Q/K rows put back in HF order."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        name = _hf_name(t.name)
        if name is None:
            raise CheckpointError(f"{path}: unexpected tensor {t.name!r}")
        yield name, unpermute_qk(name, _dequantize(t, path), cfg), str(path)


def _hf_name(gguf_name: str) -> str | None:
    for pattern, hf in _PATTERNS:
        m = pattern.match(gguf_name)
        if m:
            return hf.format(i=m.group(1)) if m.groups() else hf
    return None


def _dequantize(t: Any, path: Path) -> torch.Tensor:
    """Dequantize one tensor with the gguf package's vectorised numpy kernels; shape is HF's (rows, cols)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists the fastest-varying dimension first
    try:
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.asarray(t.data, dtype=np.float32)
        else:
            arr = dequantize(t.data, t.tensor_type)
        arr = arr.reshape(shape)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {t.name!r} has unsupported type {t.tensor_type.name}") from None
    except (ValueError, IndexError, TypeError) as e:
        raise CheckpointError(f"{path}: tensor {t.name!r} is corrupt or truncated ({e})") from None
    return torch.from_numpy(np.ascontiguousarray(arr))


def unpermute_qk(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Undo llama.cpp's Q/K row interleave so rotary halves are laid out as in HF checkpoints."""
    if cfg.architecture != "llama":
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
