"""ModelConfig: one normalised description of a decoder-only model, whichever family and file it came from.

`config_hf.config_from_hf` builds it from a Hugging Face config.json, `config_gguf.config_from_gguf` from GGUF
metadata; the family files (models/llama.py, gemma.py, phi3.py, moe.py, gpt_oss.py) say what their family sets. Nothing here
knows the families: every field is a plain property of the network, with the Llama value as its default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from lmserve.errors import CheckpointError

SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3", "longrope", "yarn"}
ACTIVATIONS = {"silu", "gelu_tanh", "swiglu_oai"}  # the gated MLP's activation: SwiGLU, GeGLU, gpt-oss's clamped SwiGLU
LAYER_TYPES = {"full", "sliding"}
MAX_SIZE = 10_000_000  # the largest count or width a config may give (layers, heads, vocabulary, context...)


@dataclass(frozen=True)
class VisionConfig:
    """A vision tower (a ViT over image patches) and the connector that maps its output into the text model's
    embedding space (defaults: SigLIP-so400m as SmolVLM uses it)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_layers: int = 27
    num_heads: int = 16
    image_size: int = 384  # the side of one frame the tower takes (Idefics3: a tile)
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_tanh"  # the MLP's activation: gelu_tanh (gelu_pytorch_tanh) or gelu
    scale_factor: int = 1  # the connector's pixel shuffle: scale_factor^2 patches become one embedding
    image_token_id: int | None = None  # the placeholder token whose embeddings the image's replace
    # LLaVA's: the tower's hidden states read (0 = embeddings, -1 = last layer), CLS dropped ("default") or kept
    # ("full"), and its 2-layer projector's activation and biases
    feature_layers: tuple[int, ...] = (-1,)
    feature_select: str = "full"
    projector_act: str = "gelu"
    projector_bias: bool = True
    tokens_per_image: int | None = None  # Gemma 3: the patch grid average-pooled to this many soft tokens
    # Qwen2.5-VL (scale_factor: its spatial merge): frames per patch, the attention window in pixels and the blocks
    # that attend over the whole image instead
    temporal_patch_size: int = 1
    window_size: int = 0
    fullatt_blocks: tuple[int, ...] = ()

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder: the shared shape, then what sets families apart (defaults: Llama)."""

    architecture: str  # the HF `architectures` entry or GGUF `general.architecture` it was read as
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None  # the table of full-attention layers (of every layer without a local one)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    o_bias: bool = False  # Llama's `attention_bias` also puts a bias on o_proj
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    hidden_act: str = "silu"  # gated MLP activation: silu (SwiGLU) or gelu_tanh (GeGLU: Gemma)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # norms before and after both attention and MLP (Gemma 2/3)
    norm_offset: float = 0.0  # every norm scales by (norm_offset + w): 1.0 for Gemma's HF weights
    embed_scale: float | None = None  # embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (Gemma); None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention scores soft-capped by tanh (Gemma 2)
    final_softcap: float | None = None  # logits soft-capped by tanh (Gemma 2)
    sliding_window: int | None = None  # what "sliding" layers see: the last W tokens, the current one included
    layer_types: tuple[str, ...] = ()  # "full" or "sliding" per layer; (): every layer full
    local_rope_theta: float | None = None  # sliding layers' own RoPE base, unscaled (Gemma 3); None: one table
    rotary_dim: int | None = None  # rotated width of each head (partial rotary: Phi-3.5/4-mini); None: head_dim
    no_rope_layers: tuple[int, ...] = ()  # layers that attend without rotary (SmolLM3's NoPE layers)
    # M-RoPE (Qwen2.5-VL): frequency pairs turned by the time, height and width position axes; (): one axis
    mrope_section: tuple[int, ...] = ()
    attn_sinks: bool = False  # a learned per-head logit joins each softmax's denominator (gpt-oss)
    max_model_len: int | None = None  # the served context when known at load: LongRoPE picks its factors by it
    # encoders (models/bert.py): bidirectional, post-norm, learned positions; they pool, never generate
    encoder: bool = False
    type_vocab_size: int = 0  # BERT's segment embeddings (2: a pair's second text is type 1)
    position_offset: int = 0  # XLM-R: positions start at padding_idx + 1
    num_labels: int = 0  # a *ForSequenceClassification head's outputs; 0: none
    sep_token_id: int | None = None  # the separator that starts a pair's second segment
    # rotary encoders (models/rotary_encoder.py); an encoder's sliding layer sees keys within ±sliding_window
    norm_bias: bool = True  # LayerNorms have a bias (ModernBERT's norm_bias may say no)
    classifier_bias: bool = True  # ModernBERT's head dense has a bias
    classifier_act: str = "gelu"  # ModernBERT's head activation
    # mixture of experts (Mixtral, Qwen2/3-MoE); num_experts 0: every layer has the dense gated MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int | None = None  # each expert's width; None: intermediate_size (Mixtral)
    norm_topk_prob: bool = True  # renormalise the top-k softmax weights to sum to 1 (Mixtral, Qwen3-MoE configs)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert scaled by sigmoid(gate(x)); 0: none
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model that keep the dense MLP (Qwen's mlp_only_layers)
    moe_bias: bool = False  # the router and every expert projection have a bias (gpt-oss)
    softmax_after_topk: bool = False  # the top k router logits, then a softmax over those k (gpt-oss)
    # a vision-language model's image encoder; None: text only, and a request with an image is a 400 naming the model
    vision: VisionConfig | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def rotated_dim(self) -> int:
        """How many dims of each head rotate."""
        return self.rotary_dim or self.head_dim

    @property
    def expert_size(self) -> int:
        """Each expert's intermediate width."""
        return self.moe_intermediate_size or self.intermediate_size

    def is_moe_layer(self, i: int) -> bool:
        """Does layer i route its tokens to experts (else: the dense gated MLP)?"""
        return self.num_experts > 0 and i not in self.dense_layers

    def layer_type(self, i: int) -> str:
        """"full" or "sliding" for layer i."""
        return self.layer_types[i] if self.layer_types else "full"

    def window(self, i: int) -> int | None:
        """The attention window of layer i (None: the whole context)."""
        return self.sliding_window if self.layer_type(i) == "sliding" else None

    def rope_kind(self, i: int) -> str | None:
        """Which rotary table layer i reads: "full", "sliding" (its own base), or None (no rotary)."""
        if i in self.no_rope_layers:
            return None
        return "sliding" if self.local_rope_theta is not None and self.layer_type(i) == "sliding" else "full"

    def validate(self) -> None:
        """Reject impossible or unsupported hyperparameters with a readable message."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value > MAX_SIZE:
                raise CheckpointError(f"config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.rotated_dim % 2 or self.rotated_dim > self.head_dim:
            raise CheckpointError(f"config: the rotated width must be even and at most head_dim ({self.head_dim}), "
                                  f"got {self.rotated_dim}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise CheckpointError(f"config: rope_theta must be positive, got {self.rope_theta}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise CheckpointError(f"config: rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.mrope_section and (len(self.mrope_section) != 3 or min(self.mrope_section) < 0
                                   or sum(self.mrope_section) != self.rotated_dim // 2):
            raise CheckpointError(f"config: mrope_section {list(self.mrope_section)} must be 3 sections summing to "
                                  f"half the rotated width ({self.rotated_dim // 2})")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(
                f"config: rope scaling type {self.rope_type!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))})")
        if not self.encoder and self.hidden_act not in ACTIVATIONS:  # an encoder's own (models/bert.py)
            raise CheckpointError(f"config: activation {self.hidden_act!r} is not supported "
                                  f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        self._validate_layers()
        self._validate_experts()

    def _validate_layers(self) -> None:
        if self.layer_types and (len(self.layer_types) != self.num_layers or set(self.layer_types) - LAYER_TYPES):
            raise CheckpointError(f"config: layer_types must name 'full' or 'sliding' for each of the "
                                  f"{self.num_layers} layers, got {list(self.layer_types)}")
        if "sliding" in self.layer_types and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise CheckpointError(f"config: sliding layers need a positive sliding_window, got {self.sliding_window!r}")
        if any(not 0 <= i < self.num_layers for i in self.no_rope_layers):
            raise CheckpointError(f"config: no_rope_layers {list(self.no_rope_layers)} outside 0..{self.num_layers - 1}")
        for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar", "embed_scale", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise CheckpointError(f"config: {name} must be positive, got {value}")

    def _validate_experts(self) -> None:
        if self.num_experts == 0:
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts or self.num_experts > 4096:
            raise CheckpointError(f"config: num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                                  f"got {self.num_experts_per_tok}")
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0 or value > 10_000_000):
                raise CheckpointError(f"config: {name} must be a non-negative integer, got {value!r}")
        if self.expert_size <= 0:
            raise CheckpointError(f"config: the experts' intermediate size must be positive, got {self.expert_size}")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise CheckpointError(f"config: dense (mlp_only) layers {list(self.dense_layers)} outside "
                                  f"0..{self.num_layers - 1}")
