"""gpt-oss (`GptOssForCausalLM`, GGUF `gpt-oss`): the shared CausalLM with attention sinks (a learned logit per
head in each softmax's denominator), sliding-window (128) layers alternating with full ones, YaRN rotary, biases on
q/k/v/o, and a mixture of experts whose router has a bias and takes a softmax over its top-k logits, and whose
experts have biases and the clamped SwiGLU (layers/kernels/fused.py `swiglu_oai_and_mul`).

Checkpoints: HF stores the experts stacked and transposed (`experts.gate_up_proj` [E, hidden, 2I] with gate and up
columns interleaved, `experts.down_proj` [E, I, hidden], biases [E, 2I] and [E, hidden]); the published ones hold
the expert weights in MXFP4 (`quantization_config.quant_method == "mxfp4"`: `*_blocks` [E, rows, K/32, 16] of
4-bit E2M1 codes, two a byte, low nibble first, and `*_scales` [E, rows, K/32] E8M0 exponents). Those are
dequantized to float at load (`mxfp4_stream`): exact, but 8x the file's bytes in float32. A GGUF's MXFP4 expert
tensors (ggml's block: the exponent byte, then 16 bytes whose low nibbles are values 0-15 and high ones 16-31) are
dequantized by the GGUF reader the same way.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from lmserve.errors import CheckpointError
from lmserve.layers.kernels.fused import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from lmserve.models.config import ModelConfig
from lmserve.models.family import Family, Fields, GGUFMeta, Tensors, gguf_expert_fields

Weights = Iterator[tuple[str, torch.Tensor, str]]

# E2M1 code -> value (sign bit, 2 exponent bits, 1 mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

GGUF_NAMES = {  # llama.cpp's gpt-oss names beyond Llama's (`*`: the stacked experts, split by the GGUF reader)
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.attn_sinks.weight": "model.layers.{i}.self_attn.sinks",
    "blk.{i}.ffn_gate_inp.bias": "model.layers.{i}.mlp.gate.bias",
    "blk.{i}.ffn_gate_exps.bias": "model.layers.{i}.mlp.experts.*.gate_proj.bias",
    "blk.{i}.ffn_up_exps.bias": "model.layers.{i}.mlp.experts.*.up_proj.bias",
    "blk.{i}.ffn_down_exps.bias": "model.layers.{i}.mlp.experts.*.down_proj.bias",
}


def _check_swiglu(alpha: Any, limit: Any) -> None:
    if float(alpha) != SWIGLU_OAI_ALPHA or float(limit) != SWIGLU_OAI_LIMIT:
        raise CheckpointError(f"config: gpt-oss's swiglu_alpha {alpha} / swiglu_limit {limit} are not supported "
                              f"(supported: {SWIGLU_OAI_ALPHA} / {SWIGLU_OAI_LIMIT}, every published config's)")


def _shared(n: int) -> Fields:
    """What every gpt-oss file means: llama.cpp hard-codes the even layers as the sliding ones, as HF's default."""
    return {"attn_sinks": True, "qkv_bias": True, "o_bias": True, "moe_bias": True, "softmax_after_topk": True,
            "hidden_act": "swiglu_oai", "norm_topk_prob": False,
            "layer_types": tuple("sliding" if i % 2 == 0 else "full" for i in range(n))}


def _gpt_oss_hf(cfg: Mapping[str, Any]) -> Fields:
    _check_swiglu(cfg.get("swiglu_alpha", SWIGLU_OAI_ALPHA), cfg.get("swiglu_limit", SWIGLU_OAI_LIMIT))
    fields = _shared(int(cfg["num_hidden_layers"])) | {
        "sliding_window": cfg.get("sliding_window", 128), "num_experts": int(cfg["num_local_experts"]),
        # the released config.json also spells it `experts_per_token`
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or cfg["experts_per_token"]),
        "moe_intermediate_size": int(cfg["intermediate_size"])}
    if not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):  # transformers' default: YaRN x32 over 4096
        fields["rope_scaling"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 4096}
    return fields


def _gpt_oss_gguf(m: GGUFMeta) -> Fields:
    fields = _shared(int(m.require("block_count"))) | gguf_expert_fields(m, renormalize=False)
    fields |= {"sliding_window": int(m.get("attention.sliding_window", 128)), "norm_topk_prob": False}
    return fields


def expert_tensors(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> Tensors:
    """One HF tensor -> the names the model loads: the router as `mlp.gate`, stacked experts split per expert (gate
    and up de-interleaved into halves, weights as [out, in])."""
    name = name.replace(".mlp.router.", ".mlp.gate.")
    prefix, _, leaf = name.rpartition(".mlp.experts.")
    if not prefix or "." in leaf:  # not stacked: the GGUF reader's per-expert tensors, attention, norms, router
        yield name, tensor
        return
    base = f"{prefix}.mlp.experts"
    for e in range(tensor.shape[0]):
        if leaf == "gate_up_proj":  # [hidden, 2I], columns gate 0, up 0, gate 1, ...
            w = tensor[e].t()
            yield f"{base}.{e}.gate_proj.weight", w[0::2]
            yield f"{base}.{e}.up_proj.weight", w[1::2]
        elif leaf == "gate_up_proj_bias":
            yield f"{base}.{e}.gate_proj.bias", tensor[e][0::2]
            yield f"{base}.{e}.up_proj.bias", tensor[e][1::2]
        elif leaf == "down_proj":  # [I, hidden]
            yield f"{base}.{e}.down_proj.weight", tensor[e].t()
        elif leaf == "down_proj_bias":
            yield f"{base}.{e}.down_proj.bias", tensor[e]
        else:
            raise CheckpointError(f"unexpected gpt-oss expert tensor {name!r}")


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """HF's MXFP4: blocks [..., G, 16] uint8 (value 2j in the low nibble of byte j, 2j + 1 in the high one), scales
    [..., G] uint8 (E8M0: 2 ** (s - 127) for the group's 32 values) -> float32 [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise CheckpointError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                              f"{scales.dtype} do not match (expected [..., G, 16] and [..., G], uint8)")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.ldexp(table[codes], scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)


def mxfp4_stream(weights: Weights, cfg: ModelConfig) -> Weights:
    """Pair each `<name>_blocks` with its `<name>_scales` and yield `<name>` dequantized, in HF's float orientation
    ([E, in, out]: a view, no copy); every other tensor passes as it is."""
    pending: dict[str, tuple[torch.Tensor, str]] = {}
    for name, tensor, source in weights:
        for suffix, other in (("_blocks", "_scales"), ("_scales", "_blocks")):
            if name.endswith(suffix):
                base = name[:-len(suffix)]
                if base + other not in pending:
                    pending[name] = (tensor, source)
                    break
                mate = pending.pop(base + other)[0]
                blocks, scales = (tensor, mate) if suffix == "_blocks" else (mate, tensor)
                yield base, mxfp4_dequantize(blocks, scales).transpose(-1, -2), source
                break
        else:
            yield name, tensor, source
    if pending:
        raise CheckpointError(f"MXFP4 tensors without their blocks or scales: {sorted(pending)[:3]}")


GPT_OSS = Family("gpt-oss", hf_fields=_gpt_oss_hf, gguf_fields=_gpt_oss_gguf, gguf_names=GGUF_NAMES,
                 checkpoint_tensors=expert_tensors, checkpoint_stream=mxfp4_stream)
