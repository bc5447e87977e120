"""The one causal LM every family builds: embedding, decoder layers (plain or sandwich), final norm, LM head.

The forward takes the tokens of many sequences concatenated (no padding) with their positions, and
leaves attention to an `AttentionContext` (no cache for tests, the paged KV cache in the engine).
What differs between families is configuration (models/config.py): the attention options of each
layer, the MLP's activation, the norms' offset and placement, the rotary tables. Parameters are named
as in Hugging Face checkpoints, except that q/k/v and gate/up are fused into one matrix each;
`load_weights` places the separate checkpoint tensors into them.

Speed-ups are transforms of a finished model, never branches here: weight formats swap the linears
(layers/formats/linear.py, quantized.py, loader/gguf_packed.py), tensor parallelism wraps them (layers/formats/parallel.py),
and the native decode stack replaces `layer_loop` (layers/kernels/decode_stack.py). `LayerLoop` is the reference.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from lmserve.errors import CheckpointError
from lmserve.layers.attention.context import AttentionContext, AttnOptions
from lmserve.layers.blocks.mlp import GatedMLP
from lmserve.layers.blocks.moe import SparseMoE
from lmserve.layers.blocks.norm import RMSNorm
from lmserve.layers.blocks.rotary import RotaryTables
from lmserve.layers.blocks.self_attention import AttentionSpec, SelfAttention
from lmserve.models.config import ModelConfig
from lmserve.models.rope import rope_specs

Rope = dict[str, tuple[torch.Tensor, torch.Tensor]]  # table kind -> (cos, sin), each [T, 1, rotary_dim]


def attention_spec(cfg: ModelConfig, i: int) -> AttentionSpec:
    """Layer i's attention: heads, biases, QK-norm, rotary table, scale, window, soft-cap and sinks."""
    scale = cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar is not None else None
    return AttentionSpec(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias, cfg.o_bias,
                         cfg.rms_norm_eps if cfg.qk_norm else None, cfg.norm_offset, cfg.rope_kind(i),
                         AttnOptions(scale=scale, window=cfg.window(i), soft_cap=cfg.attn_softcap), cfg.attn_sinks)


def mlp_of(cfg: ModelConfig, i: int) -> nn.Module:
    """Layer i's MLP: the gated MLP, or a mixture of gated experts (Mixtral, Qwen2/3-MoE) in an MoE layer."""
    if cfg.is_moe_layer(i):
        return SparseMoE(cfg.hidden_size, cfg.expert_size, cfg.num_experts, cfg.num_experts_per_tok,
                         cfg.norm_topk_prob, cfg.hidden_act, cfg.shared_expert_intermediate_size, cfg.moe_bias,
                         cfg.softmax_after_topk)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)


class DecoderLayer(nn.Module):
    """Pre-norm attention block and pre-norm MLP block, each with a residual (Llama, Qwen, Mistral, Phi-3).

    The residual stream travels beside the block outputs (as in vLLM) so that each residual add
    happens inside the next norm: (block output, residual) in, (MLP output, residual) out.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.self_attn = SelfAttention(attention_spec(cfg, layer_idx), layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mlp = mlp_of(cfg, layer_idx)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                attn: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, attn), residual)
        return self.mlp(h), residual


class SandwichDecoderLayer(nn.Module):
    """Norms before and after both blocks (Gemma 2/3): residual + post_norm(block(pre_norm(residual))).

    HF's names: input_layernorm / post_attention_layernorm around attention, pre_feedforward_layernorm /
    post_feedforward_layernorm around the MLP. The layer returns its post-normed MLP output beside the
    residual stream, which the next layer's input norm adds (as in DecoderLayer).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        norm = (cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.input_layernorm = RMSNorm(*norm)
        self.self_attn = SelfAttention(attention_spec(cfg, layer_idx), layer_idx)
        self.post_attention_layernorm = RMSNorm(*norm)
        self.pre_feedforward_layernorm = RMSNorm(*norm)
        self.mlp = mlp_of(cfg, layer_idx)
        self.post_feedforward_layernorm = RMSNorm(*norm)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                attn: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, attn))[0]
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h))[0], residual


class LayerLoop(nn.Module):
    """The decoder layers one after another: the reference path (a transform may replace it for some steps)."""

    def forward(self, layers: nn.ModuleList, x: torch.Tensor, rope: Rope,
                attn: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's output, residual stream): the final norm adds the two."""
        residual = None
        for layer in layers:
            x, residual = layer(x, residual, rope, attn)
        return x, residual


class Decoder(nn.Module):
    """Embedding, decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layer = SandwichDecoderLayer if cfg.sandwich_norm else DecoderLayer
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)


class CausalLM(nn.Module):
    """The full causal LM. `forward` returns hidden states; `compute_logits` applies the LM head."""

    # checkpoint name fragment -> (fused parameter fragment, shard index)
    FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # sub-modules loaded name for name, never fused (a vision tower's q/k/v stay apart): models/idefics3.py
    ENCODER_PREFIXES: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # Rotary frequencies are buffers: they follow .to(device); the loader recomputes them where the model
        # was built on the meta device, and divides them by a GGUF's rope_freqs (models/rope.py).
        self.rotary = RotaryTables(rope_specs(cfg), cfg.mrope_section)
        self.layer_loop: nn.Module = LayerLoop()

    def tie_weights(self) -> None:
        """Tied models share one Parameter between embedding and LM head (re-done after `to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the first layer's input [T, hidden] (where a vision model's runner places images)."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.config.embed_scale is not None:  # Gemma: the scale rounded to the activations' dtype first, as HF
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size]; `inputs_embeds` [T, hidden] replaces
        embed(input_ids) (a prompt with images placed in it). An M-RoPE model (cfg.mrope_section) also takes
        positions [3, T] (time, height, width: a step that holds image tokens)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        h, residual = self.layer_loop(self.model.layers, x, self.rotary(positions, x.dtype), attn)
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32 (callers pass only rows they sample)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor, str]]) -> None:
        """Copy (hf_name, tensor, source_file) into parameters; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())
        expected = self._expected_shards(params)
        sources: dict[str, None] = {}  # the files read, in order: a missing tensor's message names them
        for name, tensor, source in weights:
            sources[source] = None
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
            files = ", ".join(list(filter(None, sources))[:3]) or "checkpoint"
            raise CheckpointError(f"{files}: missing {len(missing)} tensor(s), e.g. {missing[:3]}")

    def _target(self, name: str) -> tuple[str, int | None]:
        if self.ENCODER_PREFIXES and name.startswith(self.ENCODER_PREFIXES):
            return name, None
        for frag, (fused, shard) in self.FUSED.items():
            if f".{frag}." in name:
                return name.replace(f".{frag}.", f".{fused}."), shard
        return name, None

    def _expected_shards(self, params: dict[str, nn.Parameter]) -> set[tuple[str, int | None]]:
        out: set[tuple[str, int | None]] = set()
        for name in params:
            if self.ENCODER_PREFIXES and name.startswith(self.ENCODER_PREFIXES):
                out.add((name, None))
            elif ".qkv_proj." in name:
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
        # gate_up: two halves of whatever width this MLP has (dense, expert or shared expert)
        sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size] if shard_of_qkv(name) else [dest.shape[0] // 2] * 2
        dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
    if tuple(tensor.shape) != tuple(dest.shape):
        raise CheckpointError(
            f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)} from the config")
    with torch.no_grad():
        dest.copy_(tensor)
