"""Rotary encoders: ModernBERT (bare or with a sequence-classification head) and NomicBERT (transformers'
`NomicBertModel`, model_type `nomic_bert`).

They run in the engine's steps as models/bert.py's encoders do (padding-free [T] ids and positions, every prompt
whole in one step, attention per sequence with `bidirectional`), with rotary positions instead of a learned table:
- ModernBERT: pre-norm, no biases, embeddings LayerNorm, Wqkv, GeGLU (`Wi` = [input | gate]), a final norm; its
  layers alternate global attention and a local one where a token sees keys at most `local_attention // 2` positions
  away on either side (kept as `sliding_window`, the half window), each kind with its own rotary base. Its
  classification head (dense, activation, norm, classifier) reads the CLS vector (`classifier_pooling` "cls").
- NomicBERT: BERT's post-norm layout with token-type embeddings, no position table, rotary q/k, no linear biases,
  SwiGLU. (nomic-ai's Hub checkpoints with remote code name tensors differently; transformers' port is read.)
Both load from a GGUF as llama.cpp's converter writes them: `modern-bert` (`_MODERN_GGUF` onto HF's names, the
window pattern and rotary bases from `_modern_gguf`) and `nomic-bert` (`_NOMIC_GGUF` onto nomic-ai's names).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import nn

from lmserve.errors import CheckpointError
from lmserve.layers.blocks.fused_linear import ACTS, linear_add
from lmserve.layers.blocks.norm import LayerNorm
from lmserve.models.bert import Encoder, StepSequences, bidirectional, step_sequences
from lmserve.models.config import ModelConfig
from lmserve.models.family import Family, Fields, GGUFMeta
from lmserve.models.rope import rope_specs


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary on x [T, H, D] at positions [T], computed in float32 (transformers' ModernBERT does)."""
    freqs = positions[:, None].float() * inv_freq[None, :]  # [T, D/2]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def attend(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, seqs: StepSequences,
           window: int | None = None) -> torch.Tensor:
    """qkv [T, 3, H, D]: q and k rotated, then each sequence's bidirectional attention -> [T, H * D]."""
    q, k, v = qkv.unbind(1)
    qkv = torch.stack((rotate(q, positions, inv_freq), rotate(k, positions, inv_freq), v), dim=1)
    return bidirectional(qkv, seqs, window)


class ModernBertLayer(nn.Module):
    """Pre-norm attention (layer 0 reads the normed embeddings as they are) and a GeGLU MLP, no biases."""

    def __init__(self, cfg: ModelConfig, i: int) -> None:
        super().__init__()
        h, eps, bias = cfg.hidden_size, cfg.rms_norm_eps, cfg.mlp_bias
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.window, self.kind = cfg.window(i), cfg.rope_kind(i) or "full"
        self.attn_norm = LayerNorm(h, eps=eps, bias=cfg.norm_bias) if i else nn.Identity()
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h, h, bias=cfg.o_bias)
        self.mlp_norm = LayerNorm(h, eps=eps, bias=cfg.norm_bias)
        self.up = nn.Linear(h, 2 * cfg.intermediate_size, bias=bias)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=bias)
        self.act = ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, freqs: dict[str, torch.Tensor],
                seqs: StepSequences) -> torch.Tensor:
        qkv = self.qkv(self.attn_norm(x)).view(x.shape[0], 3, self.num_heads, self.head_dim)
        x = linear_add(self.o_proj, attend(qkv, positions, freqs[self.kind], seqs, self.window), x)
        inp, gate = self.up(self.mlp_norm(x)).chunk(2, dim=-1)
        return linear_add(self.down, self.act(inp) * gate, x)


class NomicBertLayer(nn.Module):
    """BERT's post-norm layer with rotary q/k and a SwiGLU MLP (gate, up, down), no linear biases."""

    def __init__(self, cfg: ModelConfig, i: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(h, 3 * cfg.num_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=False)
        self.attn_norm = LayerNorm(h, eps=eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.mlp_norm = LayerNorm(h, eps=eps)
        self.act = ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, freqs: dict[str, torch.Tensor],
                seqs: StepSequences) -> torch.Tensor:
        qkv = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        x = self.attn_norm(linear_add(self.o_proj, attend(qkv, positions, freqs["full"], seqs), x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.mlp_norm(linear_add(self.down, self.act(gate) * up, x))


class RotaryEncoderModel(Encoder):
    """ModernBERT / NomicBERT over a padding-free step: forward(ids [T], positions [T], ctx) -> hidden [T, H]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.modern = cfg.architecture.startswith("ModernBert") or cfg.architecture == "modern-bert"  # HF | GGUF
        self.sep_token_id = cfg.sep_token_id
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        if cfg.type_vocab_size:
            self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.embed_norm = LayerNorm(h, eps=cfg.rms_norm_eps, bias=cfg.norm_bias)
        layer = ModernBertLayer if self.modern else NomicBertLayer
        self.blocks = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = LayerNorm(h, eps=cfg.rms_norm_eps, bias=cfg.norm_bias) if self.modern else None
        if cfg.num_labels:  # ModernBERT's head: dense, activation, norm; then the classifier
            self.head_dense = nn.Linear(h, h, bias=cfg.classifier_bias)
            self.head_norm = LayerNorm(h, eps=cfg.rms_norm_eps, bias=cfg.norm_bias)
            self.head_out = nn.Linear(h, cfg.num_labels)
        # the tables' inverse frequencies (float32) are computed at the first step on the step's device, not
        # loaded: a model built on the meta device (loader/empty_model.py) has nothing to materialise
        self._freqs: dict[str, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        seqs = step_sequences(positions, input_ids.shape[0])
        if not self._freqs or next(iter(self._freqs.values())).device != positions.device:
            self._freqs = {kind: inv.to(positions.device) for kind, (inv, _) in rope_specs(self.config).items()}
        x = self.word_embeddings(input_ids)
        if self.config.type_vocab_size:
            x = x + self.token_type_embeddings(self._token_types(input_ids, positions == 0))
        x = self.embed_norm(x)
        for layer in self.blocks:
            x = layer(x, positions, self._freqs, seqs)
        return self.final_norm(x) if self.final_norm is not None else x

    def score(self, cls: torch.Tensor) -> torch.Tensor:
        """The classification head's logits: CLS vectors [N, H] -> [N, num_labels]."""
        act = ACTS[self.config.classifier_act]
        return self.head_out(self.head_norm(act(self.head_dense(cls.to(self.word_embeddings.weight.dtype)))))


_MODERN_NAMES = {"embeddings.tok_embeddings": "word_embeddings", "embeddings.norm": "embed_norm",
                 "final_norm": "final_norm", "head.dense": "head_dense", "head.norm": "head_norm",
                 "classifier": "head_out"}
_MODERN_LAYER = {"attn.Wqkv": "qkv", "attn.Wo": "o_proj", "mlp.Wi": "up", "mlp.Wo": "down", "attn_norm": "attn_norm",
                 "mlp_norm": "mlp_norm"}
# NomicBERT tensors as nomic-ai's checkpoints (and transformers' save_pretrained) name them, and as transformers'
# port names them in memory: both -> ours; the MLP's gate (fc12 / gate_proj) and up (fc11 / up_proj) are fused
_NOMIC_NAMES = {"embeddings.word_embeddings": "word_embeddings",
                "embeddings.token_type_embeddings": "token_type_embeddings", "emb_ln": "embed_norm",
                "embeddings.LayerNorm": "embed_norm"}
_NOMIC_LAYER = {"attn.Wqkv": "qkv", "attn.out_proj": "o_proj", "self_attn.o_proj": "o_proj", "norm1": "attn_norm",
                "post_attention_layernorm": "attn_norm", "mlp.fc2": "down", "mlp.down_proj": "down",
                "norm2": "mlp_norm", "post_mlp_layernorm": "mlp_norm"}
# held back and fused on the way in: (ours, index, parts)
_NOMIC_FUSED = {"self_attn.q_proj": ("qkv", 0, 3), "self_attn.k_proj": ("qkv", 1, 3), "self_attn.v_proj": ("qkv", 2, 3),
                "mlp.fc12": ("gate_up", 0, 2), "mlp.gate_proj": ("gate_up", 0, 2),
                "mlp.fc11": ("gate_up", 1, 2), "mlp.up_proj": ("gate_up", 1, 2)}


def _modern_stream(weights: Iterator[tuple[str, torch.Tensor, str]],
                   cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor, str]]:
    """HF ModernBERT tensors -> ours: the task checkpoint's `model.` prefix stripped; an MLM head dropped."""
    for name, tensor, source in weights:
        name = name.removeprefix("model.")
        module, kind = name.rsplit(".", 1)
        if module.startswith("layers."):
            _, i, rest = module.split(".", 2)
            yield f"blocks.{i}.{_MODERN_LAYER.get(rest, rest)}.{kind}", tensor, source
        elif module in ("decoder", "head.dense", "head.norm") and not cfg.num_labels:
            continue  # ModernBertForMaskedLM's head: an embedder never reads it
        else:
            yield f"{_MODERN_NAMES.get(module, module)}.{kind}", tensor, source


def _nomic_stream(weights: Iterator[tuple[str, torch.Tensor, str]],
                  cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor, str]]:
    """transformers' NomicBERT tensors -> ours: q/k/v and gate/up held back and fused; a pooler and saved buffers
    dropped."""
    pending: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor, source in weights:
        name = name.removeprefix("nomic_bert.").removeprefix("bert.").removeprefix("encoder.")
        if name.startswith(("pooler.", "lm_head.", "cls.")) or name.endswith(("position_ids", "token_type_ids")):
            continue
        module, kind = name.rsplit(".", 1)
        if not module.startswith("layers."):
            yield f"{_NOMIC_NAMES.get(module, module)}.{kind}", tensor, source
            continue
        _, i, rest = module.split(".", 2)
        if rest not in _NOMIC_FUSED:
            yield f"blocks.{i}.{_NOMIC_LAYER.get(rest, rest)}.{kind}", tensor, source
            continue
        target, j, n = _NOMIC_FUSED[rest]
        parts = pending.setdefault(f"blocks.{i}.{target}.{kind}", [None] * n)
        parts[j] = tensor
        if all(p is not None for p in parts):
            key = f"blocks.{i}.{target}.{kind}"
            yield key, torch.cat(pending.pop(key)), source


def _modern_hf(cfg: Mapping[str, Any]) -> Fields:
    archs = cfg.get("architectures") or []
    labels = 0
    if any(str(a).endswith("ForSequenceClassification") for a in archs):
        labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
        if cfg.get("classifier_pooling", "cls") != "cls":
            raise CheckpointError(f"config.json: classifier_pooling {cfg.get('classifier_pooling')!r} is not "
                                  "supported (a classification head reads the CLS vector)")
    n, every = int(cfg["num_hidden_layers"]), int(cfg.get("global_attn_every_n_layers", 3))
    fields: Fields = {
        "encoder": True, "type_vocab_size": 0, "num_labels": labels, "num_kv_heads": int(cfg["num_attention_heads"]),
        "rms_norm_eps": float(cfg.get("norm_eps", 1e-5)), "hidden_act": _act(cfg, "hidden_activation", "gelu"),
        "classifier_act": _act(cfg, "classifier_activation", "gelu"),
        "norm_bias": bool(cfg.get("norm_bias", False)), "classifier_bias": bool(cfg.get("classifier_bias", False)),
        "qkv_bias": bool(cfg.get("attention_bias", False)), "o_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": bool(cfg.get("mlp_bias", False)), "sep_token_id": cfg.get("sep_token_id"),
        # an encoder's sliding layer sees keys within ±window (ModernBERT's local_attention is the whole span)
        "sliding_window": int(cfg.get("local_attention", 128)) // 2,
        "layer_types": tuple("sliding" if i % every else "full" for i in range(n)),
    }
    if "global_rope_theta" in cfg:  # the original config.json; transformers 5 writes `rope_parameters` per kind
        fields |= {"rope_theta": float(cfg["global_rope_theta"]),
                   "local_rope_theta": float(cfg.get("local_rope_theta", 10000.0))}
    return fields


# nomic-ai's own config.json (its remote code's keys) -> transformers' NomicBertConfig keys
_NOMIC_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
               "n_inner": "intermediate_size", "layer_norm_epsilon": "layer_norm_eps", "rotary_emb_base": "rope_theta",
               "n_positions": "max_position_embeddings"}
# its remote code's options that change the network, and the value this file implements
_NOMIC_FIXED = {"prenorm": False, "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
                "rotary_emb_interleaved": False, "rotary_emb_fraction": 1.0, "rotary_scaling_factor": None,
                "parallel_block": False, "use_rms_norm": False, "activation_function": "swiglu"}


def _nomic_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """A config.json in nomic-ai's remote-code form read as transformers' NomicBertConfig; options this file does
    not implement are a CheckpointError naming them."""
    if "n_embd" not in raw:
        return raw
    for key, value in _NOMIC_FIXED.items():
        if key in raw and raw[key] != value:
            raise CheckpointError(f"config.json: NomicBERT's {key}={raw[key]!r} is not supported (only {value!r})")
    cfg = {_NOMIC_KEYS.get(k, k): v for k, v in raw.items()}
    return cfg | {"hidden_act": "silu"}


def _nomic_hf(cfg: Mapping[str, Any]) -> Fields:
    if any("ForSequenceClassification" in str(a) for a in cfg.get("architectures") or []):
        raise CheckpointError("config.json: NomicBERT's classification head is not supported (embedders only)")
    return {"encoder": True, "type_vocab_size": int(cfg.get("type_vocab_size", 2)),
            "num_kv_heads": int(cfg["num_attention_heads"]), "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-12)),
            "hidden_act": _act(cfg, "hidden_act", "silu"), "norm_bias": True, "sep_token_id": cfg.get("sep_token_id")}


def _act(cfg: Mapping[str, Any], key: str, default: str) -> str:
    act = str(cfg.get(key, default))
    if act not in ACTS:
        raise CheckpointError(f"config.json: {key} {act!r} is not supported ({', '.join(ACTS)})")
    return act


# llama.cpp's nomic-bert tensor names -> nomic-ai's (as `_nomic_stream` reads them; `{i}`: layer)
_NOMIC_GGUF = {f"{g}.{kind}": f"{h}.{kind}" for kind in ("weight", "bias") for g, h in {
    "token_embd": "embeddings.word_embeddings", "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "emb_ln", "blk.{i}.attn_qkv": "encoder.layers.{i}.attn.Wqkv",
    "blk.{i}.attn_output": "encoder.layers.{i}.attn.out_proj", "blk.{i}.attn_output_norm": "encoder.layers.{i}.norm1",
    "blk.{i}.ffn_up": "encoder.layers.{i}.mlp.fc11", "blk.{i}.ffn_gate": "encoder.layers.{i}.mlp.fc12",
    "blk.{i}.ffn_down": "encoder.layers.{i}.mlp.fc2", "blk.{i}.layer_output_norm": "encoder.layers.{i}.norm2",
}.items()}


def _nomic_gguf(m: GGUFMeta) -> Fields:
    """llama.cpp's nomic-bert keys (its converter writes only the SwiGLU, bias-free, post-norm embedder that
    `_NOMIC_FIXED` describes; the MoE variant is another architecture, nomic-bert-moe)."""
    types = int(m.meta.get("tokenizer.ggml.token_type_count", 2))
    if not 0 <= types <= 1024:  # the table is built before token_types.weight is read
        raise CheckpointError(f"GGUF metadata: tokenizer.ggml.token_type_count {types} is not a BERT's (0..1024)")
    sep = m.meta.get("tokenizer.ggml.seperator_token_id")  # llama.cpp's spelling of the key
    return {"encoder": True, "type_vocab_size": types, "rms_norm_eps": float(m.get("attention.layer_norm_epsilon",
                                                                                    1e-12)),
            "hidden_act": "silu", "norm_bias": True, "sep_token_id": int(sep) if sep is not None else None}


# llama.cpp's modern-bert tensor names -> HF's (as `_modern_stream` reads them; `{i}`: layer)
_MODERN_GGUF = {f"{g}.{kind}": f"{h}.{kind}" for kind in ("weight", "bias") for g, h in {
    "token_embd": "embeddings.tok_embeddings", "token_embd_norm": "embeddings.norm", "output_norm": "final_norm",
    "blk.{i}.attn_norm": "layers.{i}.attn_norm", "blk.{i}.attn_qkv": "layers.{i}.attn.Wqkv",
    "blk.{i}.attn_output": "layers.{i}.attn.Wo", "blk.{i}.ffn_norm": "layers.{i}.mlp_norm",
    "blk.{i}.ffn_up": "layers.{i}.mlp.Wi", "blk.{i}.ffn_down": "layers.{i}.mlp.Wo",
    "cls": "head.dense", "cls.norm": "head.norm", "cls.output": "classifier",
}.items()}


def _modern_gguf(m: GGUFMeta) -> Fields:
    """llama.cpp's modern-bert keys, read as its loader reads them: `attention.sliding_window` is the whole local
    span (a token sees keys within half of it on either side; absent or 0: every layer global), and layer i is
    global where i % `sliding_window_pattern` is 0 (3 where absent); the local layers' rotary base is
    `rope.freq_base_swa` (else the global one). Biases and a classification head are there where their tensors
    are; the head's activation is not in the file (ModernBERT's is GELU)."""
    n, span = int(m.require("block_count")), int(m.get("attention.sliding_window") or 0)
    every = int(m.get("attention.sliding_window_pattern") or 3)
    labels = m.get("classifier.output_labels")
    act = str(m.get("hidden_activation", "gelu"))
    if act not in ACTS:
        raise CheckpointError(f"GGUF metadata: {m.arch}.hidden_activation {act!r} is not supported "
                              f"({', '.join(ACTS)})")
    if "cls.output.weight" in m.names and m.get("classifier.pooling_type") != 2:
        # llama.cpp pools a head's input by the mean where the key says 1 or is absent (gte-reranker-modernbert)
        raise CheckpointError(f"GGUF metadata: {m.arch}.classifier.pooling_type "
                              f"{m.get('classifier.pooling_type')!r} is not supported (a classification head "
                              "reads the CLS vector: 2)")
    sep = m.meta.get("tokenizer.ggml.seperator_token_id")  # llama.cpp's spelling of the key
    fields: Fields = {
        "encoder": True, "type_vocab_size": 0, "num_labels": (len(labels) if labels else 1)
        if "cls.output.weight" in m.names else 0, "hidden_act": act, "classifier_act": "gelu",
        "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", m.get("attention.layer_norm_epsilon", 1e-5))),
        "norm_bias": "token_embd_norm.bias" in m.names, "classifier_bias": "cls.bias" in m.names,
        "qkv_bias": "blk.0.attn_qkv.bias" in m.names, "o_bias": "blk.0.attn_output.bias" in m.names,
        "mlp_bias": "blk.0.ffn_up.bias" in m.names, "sep_token_id": int(sep) if sep is not None else None}
    if span > 0:
        fields |= {"sliding_window": span // 2,
                   "layer_types": tuple("sliding" if i % every else "full" for i in range(n)),
                   "local_rope_theta": float(m.get("rope.freq_base_swa", m.get("rope.freq_base", 10000.0)))}
    return fields


MODERNBERT = Family("modernbert", hf_fields=_modern_hf, checkpoint_stream=_modern_stream, model=RotaryEncoderModel,
                    gguf_fields=_modern_gguf, gguf_names=_MODERN_GGUF)
NOMIC_BERT = Family("nomic-bert", hf_fields=_nomic_hf, text_config=_nomic_config, checkpoint_stream=_nomic_stream,
                    model=RotaryEncoderModel, gguf_fields=_nomic_gguf, gguf_names=_NOMIC_GGUF)
