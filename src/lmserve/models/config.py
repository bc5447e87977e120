"""ModelConfig: one normalised description of a Llama-family model, from a HF config.json or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from lmserve.errors import CheckpointError

# HF `architectures` / GGUF `general.architecture` values served by models/llama.py.
HF_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
GGUF_ARCHITECTURES = {"llama", "qwen2"}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections
    o_bias: bool = False  # Llama's `attention_bias` also puts a bias on o_proj
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

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

    def validate(self) -> None:
        """Reject impossible or unsupported hyperparameters with a readable message."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value > 10_000_000:
                raise CheckpointError(f"config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise CheckpointError(f"config: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise CheckpointError(f"config: rope_theta must be positive, got {self.rope_theta}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise CheckpointError(f"config: rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(
                f"config: rope scaling type {self.rope_type!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))})")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Normalise a Hugging Face config.json dict."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in HF_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"config.json: architectures {archs} not supported "
                f"(supported: {', '.join(sorted(HF_ARCHITECTURES))})")
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            max_pos = int(cfg.get("max_position_embeddings", 2048))
            rope_theta, rope_scaling = _rope_from_hf(cfg)
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch != "Qwen2ForCausalLM") else None
            if window:  # no sliding-window attention yet: never run past the window
                max_pos = min(max_pos, int(window))
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
                o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"config.json: missing or malformed field: {e}") from None

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], arch: str, vocab_size: int) -> "ModelConfig":
        """Normalise GGUF metadata (`meta` maps key -> python value, `arch` = general.architecture)."""
        if arch not in GGUF_ARCHITECTURES:
            raise CheckpointError(
                f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(GGUF_ARCHITECTURES))})")

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise CheckpointError(f"GGUF metadata: missing {arch}.{key}")
            return value

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                       or hidden // num_heads)
        scaling = None
        scale_type = meta.get(f"{arch}.rope.scaling.type")
        if scale_type == "linear":
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        elif scale_type not in (None, "none"):
            raise CheckpointError(f"GGUF metadata: rope scaling type {scale_type!r} is not supported")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings=False,  # decided by the loader from the presence of output.weight
            qkv_bias=arch == "qwen2",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )


def _rope_from_hf(cfg: Mapping[str, Any]) -> tuple[float, dict | None]:
    """rope_theta and scaling from either the classic `rope_theta` + `rope_scaling` fields or
    transformers 5's `rope_parameters` (which holds both)."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return theta, None
    return theta, dict(scaling)
