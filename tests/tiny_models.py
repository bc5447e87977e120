"""Tiny random-weight models of every served architecture, made by transformers and saved as safetensors, and
their GGUF files written with the `gguf` package the way llama.cpp's convert_hf_to_gguf.py writes them
(tensor names from gguf's own name map, Q/K rows interleaved for the Llama-derived converters, Gemma's norm
weights shifted by 1, Phi-3's fused tensors kept fused and its LongRoPE factors as tensors)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + 0.05 * i for i in range(24)],
                long_factor=[1.0 + 0.4 * i for i in range(24)])


@dataclass(frozen=True)
class Arch:
    """One architecture's tiny model: transformers' classes, the config, and the GGUF arch (None: HF only)."""

    config: str
    model: str
    kwargs: dict[str, Any]
    gguf: str | None = None
    gguf_meta: Callable[[Any, Any], None] = lambda writer, cfg: None  # arch-specific keys convert_hf_to_gguf writes
    norm_shift: float = 0.0  # Gemma: llama.cpp stores 1 + w
    permute_qk: bool = False  # the converters that interleave q/k rows (LlamaModel and its subclasses)
    moe: bool = False  # a mixture of experts (8 experts, top-2)
    extra: dict[str, Any] = field(default_factory=dict)


def _gemma2_meta(w, cfg) -> None:
    w.add_sliding_window(cfg.sliding_window)
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)


def _gemma3_meta(w, cfg) -> None:
    import gguf

    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(cfg.rope_parameters["full_attention"]["factor"])


def _phi3_meta(w, cfg) -> None:
    import math

    rot = int(cfg.hidden_size // cfg.num_attention_heads * cfg.rope_parameters["partial_rotary_factor"])
    w.add_rope_dimension_count(rot)
    orig = cfg.original_max_position_embeddings
    w.add_rope_scaling_orig_ctx_len(orig)
    scale = cfg.max_position_embeddings / orig
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
    w.add_sliding_window(cfg.sliding_window)
    w.add_tensor("rope_factors_long.weight", np.asarray(cfg.rope_parameters["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(cfg.rope_parameters["short_factor"], dtype=np.float32))


def _head_dim_meta(w, cfg) -> None:
    w.add_rope_dimension_count(cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads)


def _moe_meta(w, cfg) -> None:
    """llama.cpp's expert keys (Qwen2/3-MoE write the experts' width; Mixtral's is feed_forward_length)."""
    w.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _mixtral_meta(w, cfg) -> None:
    _head_dim_meta(w, cfg)
    _moe_meta(w, cfg)


def _gpt_oss_meta(w, cfg) -> None:
    import gguf

    _moe_meta(w, cfg)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


EXPERTS = dict(num_experts_per_tok=2, router_jitter_noise=0.0)  # 8 experts, top-2 (the count's name differs)

ARCHS: dict[str, Arch] = {
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", dict(head_dim=64), "llama", _head_dim_meta, permute_qk=True),
    "qwen3": Arch("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=64), "qwen3"),
    # head_dim 32: the engine's attention runs its PyTorch paths (the native kernel takes 64/128/256)
    "mistral": Arch("MistralConfig", "MistralForCausalLM", dict(hidden_size=64, head_dim=32, sliding_window=8)),
    "gemma2": Arch("Gemma2Config", "Gemma2ForCausalLM",
                   dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=8, attn_logit_softcapping=3.0,
                        final_logit_softcapping=8.0, tie_word_embeddings=True), "gemma2", _gemma2_meta, norm_shift=1.0),
    "gemma3": Arch("Gemma3TextConfig", "Gemma3ForCausalLM",
                   dict(num_hidden_layers=6, head_dim=64, query_pre_attn_scalar=64, sliding_window=8,
                        tie_word_embeddings=True, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}), "gemma3", _gemma3_meta, norm_shift=1.0),
    "phi3": Arch("Phi3Config", "Phi3ForCausalLM",
                 dict(max_position_embeddings=128, original_max_position_embeddings=32, sliding_window=24,
                      partial_rotary_factor=0.75, rope_scaling=LONGROPE), "phi3", _phi3_meta),
    "smollm3": Arch("SmolLM3Config", "SmolLM3ForCausalLM",
                    dict(num_hidden_layers=4, no_rope_layer_interval=4), "smollm3", _head_dim_meta, permute_qk=True),
    # every layer sparse (llama.cpp's qwen3moe has no dense layers; tests/test_moe.py covers mlp_only_layers);
    # renormalised top-k, as the released Qwen3-MoE configs and llama.cpp
    "qwen3_moe": Arch("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(EXPERTS, head_dim=64, num_experts=8, moe_intermediate_size=64, norm_topk_prob=True),
                      "qwen3moe", _moe_meta, moe=True),
    "mixtral": Arch("MixtralConfig", "MixtralForCausalLM", dict(EXPERTS, head_dim=64, num_local_experts=8,
                    intermediate_size=64), "llama", _mixtral_meta, permute_qk=True, moe=True),
    # the shared expert and its sigmoid gate; top-k weights not renormalised (llama.cpp's qwen2moe never does)
    "qwen2_moe": Arch("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                      dict(EXPERTS, num_experts=8, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                           norm_topk_prob=False), "qwen2moe", _moe_meta, moe=True),
    # two layers (one sliding, one full): sinks, windows of 8 on the even layers, YaRN (truncated ramp ends: llama.cpp's, and transformers' default;
    # tests/test_gpt_oss.py checks gpt-oss's untruncated table), biases everywhere, 4 experts top-2 of width 64
    # (a whole number of MXFP4 blocks)
    "gpt_oss": Arch("GptOssConfig", "GptOssForCausalLM",
                    dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=8,
                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                              original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                              truncate=True)),
                    "gpt-oss", _gpt_oss_meta, moe=True),
}


def build_hf(name: str, root: Path, **overrides: Any) -> tuple[Path, torch.nn.Module]:
    """The tiny model (random weights, norms and biases randomised so each matters) saved under root/name;
    `overrides` change its config (a variant of the architecture)."""
    import transformers

    arch = ARCHS[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, arch.config)(**copy.deepcopy(COMMON | arch.kwargs | overrides))
    model = getattr(transformers, arch.model)(cfg).float().eval()
    randomize_norms(model, arch.norm_shift)
    randomize_routers(model)
    path = root / name
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path)
    return path, model


def build_gemma3_multimodal(root: Path) -> tuple[Path, torch.nn.Module]:
    """A tiny Gemma3ForConditionalGeneration (a SigLIP tower beside the language model); query_pre_attn_scalar
    differs from head_dim here."""
    import transformers

    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(**copy.deepcopy(COMMON | ARCHS["gemma3"].kwargs | {"query_pre_attn_scalar": 48}))
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)
    model = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
    randomize_norms(model.model.language_model, 1.0)
    path = root / "gemma3_multimodal"
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path)
    return path, model


def randomize_norms(model: torch.nn.Module, shift: float) -> None:
    """Norm weights around their neutral value (1 for w, 0 for Gemma's 1 + w), biases random."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1.0 - shift) + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith((".bias", "_bias")):  # gpt-oss's stacked experts' `gate_up_proj_bias`
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".sinks"):  # gpt-oss: sinks that take a good share of each softmax
                p.copy_(1.0 + 2.0 * torch.randn(p.shape, generator=g))


def randomize_routers(model: torch.nn.Module) -> None:
    """Router weights that spread each token's choice over the experts (some initialise them to zeros)."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def write_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer.json over the tiny vocabulary (the tests feed token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def write_gguf(name: str, model: torch.nn.Module, path: Path, quantize: Callable[[str], str] | None = None) -> Path:
    """The model as llama.cpp's converter writes it; `quantize(gguf_name)` picks a type per tensor (default F32)."""
    import gguf

    arch, cfg = ARCHS[name], model.config
    w = gguf.GGUFWriter(str(path), arch.gguf)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if name not in ("phi3",):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if name != "gemma3":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    arch.gguf_meta(w, cfg)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.gguf.upper().replace("-", "_")], cfg.num_hidden_layers)
    for hf, tensor in model.state_dict().items():
        if "rotary_emb" in hf or (hf == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        moe = _gpt_oss_tensors(hf, tensor.float()) if name == "gpt_oss" else _moe_tensors(hf, tensor.float())
        if moe is not None:
            for gname, t in moe:
                router = ".ffn_gate_inp" in gname or gname.endswith(".bias")  # F32, as llama.cpp's converters keep them
                _add_tensor(w, gname, t.numpy(), quantize(gname) if quantize and not router else "F32")
            continue
        t = tensor.float()
        if arch.permute_qk and (".q_proj." in hf or ".k_proj." in hf):
            heads = cfg.num_attention_heads if ".q_proj." in hf else cfg.num_key_value_heads
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        if hf.endswith("norm.weight"):
            t = t + arch.norm_shift
        gname = names.get_name(hf + (".weight" if hf.endswith(".sinks") else ""), try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf
        _add_tensor(w, gname, t.numpy(), quantize(gname) if quantize else "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_SHEXP = {"shared_expert.gate_proj.weight": "ffn_gate_shexp", "shared_expert.up_proj.weight": "ffn_up_shexp",
          "shared_expert.down_proj.weight": "ffn_down_shexp", "shared_expert_gate.weight": "ffn_gate_inp_shexp"}


def _moe_tensors(hf: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """An expert layer's tensors under llama.cpp's names: experts stacked [E, rows, cols] (transformers 5 keeps them
    stacked, gate and up in one), the router F32 (llama.cpp's converters never quantize it) and Qwen2-MoE's shared
    expert, its gate a vector; None for any other tensor."""
    import re

    m = re.match(r"model\.layers\.(\d+)\.mlp\.(.+)$", hf)
    if m is None:
        return None
    blk, rest = f"blk.{m.group(1)}", m.group(2)
    if rest == "experts.gate_up_proj":
        gate, up = t.chunk(2, dim=1)
        return [(f"{blk}.ffn_gate_exps.weight", gate), (f"{blk}.ffn_up_exps.weight", up)]
    if rest == "experts.down_proj":
        return [(f"{blk}.ffn_down_exps.weight", t)]
    if rest == "gate.weight":
        return [(f"{blk}.ffn_gate_inp.weight", t)]
    if rest in _SHEXP:
        return [(f"{blk}.{_SHEXP[rest]}.weight", t[0] if rest == "shared_expert_gate.weight" else t)]
    return None


def _gpt_oss_tensors(hf: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """gpt-oss's MLP as llama.cpp's converter writes it: the router (`ffn_gate_inp`, F32) with its bias, the stacked
    experts transposed to [E, out, in] and gate/up de-interleaved (HF's columns alternate gate, up), biases split."""
    import re

    m = re.match(r"model\.layers\.(\d+)\.mlp\.(.+)$", hf)
    if m is None:
        return None
    blk, rest = f"blk.{m.group(1)}", m.group(2)
    if rest.startswith("router."):
        return [(f"{blk}.ffn_gate_inp.{rest.split('.')[1]}", t)]
    if rest == "experts.gate_up_proj":  # [E, hidden, 2I]
        w = t.transpose(1, 2)
        return [(f"{blk}.ffn_gate_exps.weight", w[:, 0::2].contiguous()),
                (f"{blk}.ffn_up_exps.weight", w[:, 1::2].contiguous())]
    if rest == "experts.gate_up_proj_bias":
        return [(f"{blk}.ffn_gate_exps.bias", t[:, 0::2].contiguous()), (f"{blk}.ffn_up_exps.bias", t[:, 1::2].contiguous())]
    if rest == "experts.down_proj":  # [E, I, hidden]
        return [(f"{blk}.ffn_down_exps.weight", t.transpose(1, 2).contiguous())]
    if rest == "experts.down_proj_bias":
        return [(f"{blk}.ffn_down_exps.bias", t)]
    raise AssertionError(hf)


def _add_tensor(w, name: str, arr: np.ndarray, kind: str) -> None:
    import gguf

    if kind == "F32" or arr.ndim == 1:
        w.add_tensor(name, arr.astype(np.float32))
        return
    qtype = gguf.GGMLQuantizationType[kind]
    w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)
