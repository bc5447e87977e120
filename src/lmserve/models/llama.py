"""One Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a flat batch of tokens.

The forward takes the tokens of many sequences concatenated (no padding) with their positions, and
leaves attention to an `AttentionContext` (no cache for tests, the paged KV cache in the engine).
Parameters are named as in Hugging Face checkpoints, except that q/k/v and gate/up are fused into
one matrix each; `load_weights` knows how to place the separate checkpoint tensors into them.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from lmserve.layers.attention import AttentionContext
from lmserve.layers.decode_stack import DecodeStack, LayerWeights, Shape
from lmserve.layers.fused import rms_norm, rotary, silu_and_mul
from lmserve.layers.rotary import cos_sin, inv_frequencies
from lmserve.errors import CheckpointError
from lmserve.models.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as the reference does, fused with the residual add."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the new residual stream comes back with the normed input."""
        return rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    """Fused QKV projection, rotary embeddings, attention through the context, output projection."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k rotate together: one set of elementwise ops per layer instead of two
        qk = rotary(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(attn.attend(self.layer_idx, q, k, v))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matrix."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block and pre-norm MLP block, each with a residual.

    The residual stream travels beside the block outputs (as in vLLM) so that each residual add
    happens inside the next norm: (block output, residual) in, (MLP output, residual) out.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, attn), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The full causal LM. `forward` returns hidden states; `compute_logits` applies the LM head."""

    # checkpoint name fragment -> (fused parameter fragment, shard index)
    FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # Rotary inverse frequencies; a buffer so it follows .to(device). GGUF may refine it at load.
        inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_type, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._decode_stack: DecodeStack | None | bool = False  # False: not built yet (weights load after init)

    def tie_weights(self) -> None:
        """Tied models share one Parameter between embedding and LM head (re-done after `to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = cos_sin(positions, self.inv_freq, x.dtype)
        stack = self._stack() if DecodeStack.accepts(attn, x) else None
        if stack is not None:  # the same kernels as the loop below, called from C++ (layers/decode_stack.py)
            x, residual = stack(x, cos, sin, attn)
        else:
            residual = None
            for layer in self.model.layers:
                x, residual = layer(x, residual, cos, sin, attn)
        return self.model.norm(x, residual)[0]

    def use_decode_stack(self, on: bool) -> bool:
        """Turn the native decode stack on (where it applies) or off; True when decode steps will use it."""
        self._decode_stack = False if on else None
        return not on or self._stack() is not None

    def _stack(self) -> DecodeStack | None:
        """The native decode stack over these layers, built at the first decode step (None where it does not apply)."""
        if self._decode_stack is False:
            cfg = self.config
            layers = [LayerWeights(l.input_layernorm.weight, l.post_attention_layernorm.weight,
                                   (l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj, l.mlp.down_proj))
                      for l in self.model.layers]
            self._decode_stack = DecodeStack.build(
                layers, Shape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps))
        return self._decode_stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32 (callers pass only rows they sample)."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]]) -> None:
        """Copy (hf_name, tensor, source_file) into parameters; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        expected = self._expected_shards(params)
        for name, tensor, source in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed from the config
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints still store a copy of the embedding
            target, shard = self._target(name)
            if target not in params:
                raise CheckpointError(f"{source}: unexpected tensor {name!r} for {self.config.architecture}")
            if (target, shard) not in expected:
                raise CheckpointError(f"{source}: tensor {name!r} appears twice")
            _copy_shard(params[target], tensor, shard, self.config, name, source)
            expected.discard((target, shard))
        if expected:
            missing = sorted({t for t, _ in expected})
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")

    def _target(self, name: str) -> tuple[str, int | None]:
        for frag, (fused, shard) in self.FUSED.items():
            if f".{frag}." in name:
                return name.replace(f".{frag}.", f".{fused}."), shard
        return name, None

    def _expected_shards(self, params: dict[str, nn.Parameter]) -> set[tuple[str, int | None]]:
        out: set[tuple[str, int | None]] = set()
        for name in params:
            if ".qkv_proj." in name:
                out |= {(name, 0), (name, 1), (name, 2)}
            elif ".gate_up_proj." in name:
                out |= {(name, 0), (name, 1)}
            else:
                out.add((name, None))
        return out


def shard_of_qkv(name: str) -> bool:
    """True for the q/k/v checkpoint tensors that fill the fused qkv_proj."""
    return any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj"))


def _copy_shard(param: nn.Parameter, tensor: torch.Tensor, shard: int | None, cfg: ModelConfig,
                name: str, source: str) -> None:
    """Copy a checkpoint tensor into its (slice of the) parameter, converting dtype in the copy."""
    dest = param.data
    if shard is not None:
        sizes = ([cfg.q_size, cfg.kv_size, cfg.kv_size] if shard_of_qkv(name)
                 else [cfg.intermediate_size, cfg.intermediate_size])
        dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
    if tuple(tensor.shape) != tuple(dest.shape):
        raise CheckpointError(
            f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)} from the config")
    with torch.no_grad():
        dest.copy_(tensor)
