"""What a model family file declares: how its config.json and GGUF metadata set ModelConfig's fields, and
how its checkpoints name and store tensors. The network itself is the shared `CausalLM` (models/decoder.py).

A family file (models/llama.py, gemma.py, phi3.py, moe.py, gpt_oss.py) defines one `Family` per architecture and
models/registry.py maps architecture names to them: adding the next family is one file and a registry line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping

import torch
from torch import nn

from lmserve.errors import CheckpointError
from lmserve.models.config import ModelConfig
from lmserve.models.decoder import CausalLM

Fields = dict[str, Any]  # ModelConfig field -> value
Tensors = Iterable[tuple[str, torch.Tensor]]


class GGUFMeta:
    """A GGUF file's metadata, read as `{arch}.key`; `tensor(name)` reads a small tensor (rope factors); `names`
    are the file's tensor names."""

    def __init__(self, meta: Mapping[str, Any], arch: str,
                 tensor: Callable[[str], torch.Tensor | None] = lambda name: None,
                 names: Collection[str] = ()) -> None:
        self.meta, self.arch, self.tensor, self.names = meta, arch, tensor, frozenset(names)

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}`, or `default` when absent."""
        return self.meta.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"GGUF metadata: missing {self.arch}.{key}")
        return value


def gguf_expert_fields(m: GGUFMeta, renormalize: bool) -> Fields:
    """llama.cpp's expert keys; a layer is sparse where the file has its router (`blk.{i}.ffn_gate_inp`). llama.cpp
    hard-codes per architecture whether the top-k weights are renormalised (`renormalize`) unless the file says."""
    count = int(m.get("expert_count") or 0)
    if count == 0:
        return {}
    n, size = int(m.require("block_count")), m.get("expert_feed_forward_length")
    return {"num_experts": count, "num_experts_per_tok": int(m.require("expert_used_count")),
            "moe_intermediate_size": int(size) if size else None,
            "norm_topk_prob": bool(m.get("expert_weights_norm", renormalize)),
            "dense_layers": tuple(i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in m.names)}


def _no_fields(_: Any) -> Fields:
    return {}


def _as_is(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Tensors:
    yield name, tensor


def _stream_as_is(weights: Iterator[tuple[str, torch.Tensor, str]],
                  cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor, str]]:
    return weights


@dataclass(frozen=True)
class Family:
    """One architecture's differences from a Llama; every hook's default is Llama's."""

    name: str
    hf_fields: Callable[[Mapping[str, Any]], Fields] = _no_fields  # config.json -> fields it sets
    gguf_fields: Callable[[GGUFMeta], Fields] = _no_fields  # GGUF metadata -> fields it sets
    # GGUF tensor name -> HF name where llama.cpp's names for this family differ from Llama's ({i}: layer)
    gguf_names: Mapping[str, str] = field(default_factory=dict)
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaved q/k rows (it rotates them "normal" style)
    # a multimodal wrapper's config.json -> the language model's (top-level token ids kept)
    text_config: Callable[[Mapping[str, Any]], Mapping[str, Any]] = lambda cfg: cfg
    # one checkpoint tensor (HF name) -> the tensors load_weights takes: renamed, split (fused qkv) or dropped
    checkpoint_tensors: Callable[[str, torch.Tensor, ModelConfig], Tensors] = _as_is
    # the whole (hf_name, tensor, file) stream before `checkpoint_tensors`, for tensors that come in pieces
    # (gpt-oss's MXFP4 `_blocks` and `_scales`, joined and dequantized)
    checkpoint_stream: Callable[[Iterator[tuple[str, torch.Tensor, str]], ModelConfig],
                                Iterator[tuple[str, torch.Tensor, str]]] = _stream_as_is
    model: Callable[[ModelConfig], nn.Module] = CausalLM
