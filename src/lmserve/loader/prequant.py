"""Pre-quantized Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors) on the packed int kernels.

`read_scheme` checks config.json's quantization_config and refuses, in one line naming the field and its value,
what cannot be loaded exactly (loader/prequant_formats.py says how each format is packed):
- gptq: 4 or 8 bits, groups of a multiple of 32 (or -1, one per row), symmetric or with zero points, desc_act
  false, checkpoint_format gptq (v1) or gptq_v2;
- awq: 4 bits, the same groups, version gemm;
- compressed-tensors: pack-quantized / int-quantized / naive-quantized integer weights of 4 or 8 bits in groups,
  rows or one per tensor (W4A16, W8A16; W8A8's activation scales are not used: activations are quantized by the
  kernel per 32 values), and float-quantized FP8 weights (W8A8 FP8), which no int kernel runs: dequantized to
  float at load. Sparse and transformed (rotated) checkpoints and act-order groups are refused.
`keep_prequantized` is the weight-format transform, the way GGUF blocks are kept (loader/gguf_packed.py): before
anything is allocated, every projection whose checkpoint tensors map exactly onto a kernel layout
(layers/formats/int_weights.py) becomes a GGUFLinear over those codes (fused q/k/v and gate/up stack their parts' rows);
no float copy of them is made. `keep_half_tables` holds the LM head and token table these checkpoints leave
unquantized in their stored bfloat16 / float16 (layers/formats/half_linear.py) instead of widening them to float32.
`dequantized_rest` then feeds the loader everything else, the layers no kernel fits dequantized to float
((code - zero) * scale: the plain reference, also the whole model's weights for
`--quantization none`, other devices and dtypes, and tensor parallelism).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from lmserve.errors import CheckpointError
from lmserve.layers.formats.gguf_linear import GGUFLinear, concat
from lmserve.layers.formats.half_linear import HalfEmbedding, HalfLinear, tied_half
from lmserve.layers.formats.int_weights import IntWeights, dequantize_int, kernel_blocks
from lmserve.loader.prequant_formats import read_awq, read_compressed_int, read_fp8, read_gptq
from lmserve.loader.sharding import TPShard, take_shard

log = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "compressed-tensors")
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized", "mixed-precision")
# a quantized layer's own tensors (the bias is the layer's, loaded as usual)
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_zero_point",
                  "weight_shape", "weight_g_idx", "weight", "input_scale", "input_zero_point", "output_scale")
KV_SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale")


@dataclass(frozen=True)
class PrequantScheme:
    """A checked quantization_config: what the loader needs to read the layers."""

    method: str  # gptq | awq | compressed-tensors
    summary: str  # for logs and LoadedModel.quantization, e.g. "gptq 4-bit g128 sym"
    bits: int = 0  # gptq: the codes' width (awq: 4; compressed-tensors: read from each layer's tensors)
    gptq_v1: bool = False  # zeros stored as zero - 1
    fp8_block: tuple[int, int] | None = None  # compressed-tensors FP8 "block" strategy: [rows, columns] per scale
    all_fp8: bool = False  # no layer has integer codes: nothing for the int kernels
    kv_scales: bool = False  # the checkpoint carries KV cache scales (not used: the KV cache is float)


def _refuse(field: str, value: object, why: str) -> CheckpointError:
    return CheckpointError(f"quantization_config.{field} = {value!r}: {why}")


def _check_group(field: str, group: object) -> int:
    if not isinstance(group, int) or group != -1 and (group <= 0 or group % 32):
        raise _refuse(field, group, "groups must be a multiple of 32 input columns (or -1, one per row) "
                                    "to map onto the int kernels' blocks of 32")
    return group


def _groups(group: int) -> str:
    return "per row" if group == -1 else f"g{group}"


def read_scheme(config: dict) -> PrequantScheme | None:
    """config.json's quantization_config checked (None: a float checkpoint); CheckpointError names what is refused."""
    q = config.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"quantization_config = {q!r}: expected an object")
    method = str(q.get("quant_method", "")).lower()
    if method == "mxfp4":  # gpt-oss's experts: its family joins their _blocks and _scales and dequantizes them
        if "GptOssForCausalLM" not in (config.get("architectures") or []):  # (models/gpt_oss.py)
            raise _refuse("quant_method", q.get("quant_method"), "read for gpt-oss's experts only")
        return None
    readers = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}
    if method not in readers:
        raise _refuse("quant_method", q.get("quant_method"), f"not loaded (accepted: {', '.join(METHODS)})")
    return readers[method](q)


def _gptq(q: dict) -> PrequantScheme:
    bits = q.get("bits")
    if bits not in (4, 8):
        raise _refuse("bits", bits, "GPTQ runs with 4- or 8-bit codes")
    group = _check_group("group_size", q.get("group_size", 128))
    if q.get("desc_act"):
        raise _refuse("desc_act", q["desc_act"], "act-order checkpoints permute the input columns; "
                                                "re-quantize with desc_act false")
    fmt = str(q.get("checkpoint_format", q.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2") or q.get("is_marlin_format"):
        field = "is_marlin_format" if q.get("is_marlin_format") else "checkpoint_format"
        raise _refuse(field, q.get(field), "only the gptq (v1) and gptq_v2 packings are loaded")
    sym = "sym" if q.get("sym", True) else "zero points"
    return PrequantScheme("gptq", f"gptq {bits}-bit {_groups(group)} {sym}", bits=bits, gptq_v1=fmt == "gptq")


def _awq(q: dict) -> PrequantScheme:
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise _refuse("bits", bits, "AWQ runs with 4-bit codes")
    group = _check_group("group_size", q.get("group_size", q.get("q_group_size", 128)))
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", q.get("version"), "only AutoAWQ's gemm packing is loaded")
    return PrequantScheme("awq", f"awq 4-bit {_groups(group)}", bits=4)


def _compressed_tensors(q: dict) -> PrequantScheme:
    for field in ("sparsity_config", "transform_config"):
        if q.get(field):
            raise _refuse(field, "...", "sparse and transformed (rotated) checkpoints are not loaded")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_status", status, "only compressed checkpoints are loaded")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse("config_groups", groups, "expected at least one group of quantized weights")
    parts, blocks, int_layers = [], set(), False
    for name, group in groups.items():
        fmt = group.get("format") or q.get("format")
        if fmt not in CT_FORMATS:
            raise _refuse(f"config_groups.{name}.format" if group.get("format") else "format", fmt,
                          f"not loaded (accepted: {', '.join(CT_FORMATS[:4])})")
        w = group.get("weights")
        if not isinstance(w, dict):
            raise _refuse(f"config_groups.{name}.weights", w, "expected quantized weights")
        summary, block, is_int = _ct_weights(f"config_groups.{name}.weights", w)
        parts.append(f"{fmt} {summary}")
        blocks.add(block)
        int_layers |= is_int
    blocks.discard(None)
    if len(blocks) > 1:
        raise _refuse("config_groups", "...", "FP8 groups with different block shapes")
    return PrequantScheme("compressed-tensors", "compressed-tensors " + "; ".join(parts),
                          fp8_block=blocks.pop() if blocks else None, all_fp8=not int_layers,
                          kv_scales=bool(q.get("kv_cache_scheme")))


def _ct_weights(field: str, w: dict) -> tuple[str, tuple[int, int] | None, bool]:
    """One compressed-tensors group's weight arguments -> (summary, FP8 block shape, integer codes?)."""
    kind, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy", "tensor")
    if w.get("dynamic"):
        raise _refuse(f"{field}.dynamic", w["dynamic"], "weights must be quantized in the checkpoint")
    if w.get("actorder") == "group":
        raise _refuse(f"{field}.actorder", "group", "act-order groups permute the input columns; "
                                                    "re-quantize with actorder static or none")
    if kind == "float":
        if bits != 8:
            raise _refuse(f"{field}.num_bits", bits, "float weights are loaded as FP8 (8 bits) only")
        block = w.get("block_structure") if strategy == "block" else None
        return f"fp8 {strategy} (dequantized to float at load)", tuple(block) if block else None, False
    if kind != "int":
        raise _refuse(f"{field}.type", kind, "expected int or float")
    if bits not in (4, 8):
        raise _refuse(f"{field}.num_bits", bits, "integer weights of 4 or 8 bits are loaded")
    if strategy not in ("group", "channel", "tensor"):
        raise _refuse(f"{field}.strategy", strategy, "accepted: group, channel, tensor")
    group = _check_group(f"{field}.group_size", w.get("group_size")) if strategy == "group" else -1
    sym = "sym" if w.get("symmetric", True) else "zero points"
    return f"w{bits} {strategy}{group if group > 0 else ''} {sym}", None, True


def auto_prequant(scheme: PrequantScheme, device: torch.device, dtype: torch.dtype,
                  world: int) -> tuple[str | None, str]:
    """`--quantization auto` for a pre-quantized checkpoint -> (scheme.method: the int kernels, or None: float; why)."""
    why_not = [what for what, bad in (("device " + str(device), device.type != "cpu"),
                                      ("dtype " + str(dtype).removeprefix("torch."), dtype != torch.float32),
                                      (f"tensor parallel size {world}", world > 1)) if bad]
    if scheme.all_fp8:
        return None, f"{scheme.summary}: FP8 weights have no int kernel"
    if why_not:
        return None, (f"{scheme.summary} dequantized to float: the int kernels run on CPU, float32, one rank; "
                      f"here: {', '.join(why_not)}")
    return scheme.method, f"{scheme.summary} on the int kernels (CPU, float32)"


class CheckpointTensors:
    """A checkpoint's tensors by name, read on demand from its memory-mapped safetensors files."""

    def __init__(self, files: list[Path]) -> None:
        self._handles = [safe_open(str(p), framework="pt", device="cpu") for p in files]
        self._where: dict[str, int] = {}
        self._source: dict[str, str] = {}
        for i, (path, f) in enumerate(zip(files, self._handles)):
            for name in f.keys():
                self._where[name], self._source[name] = i, str(path)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def source(self, name: str) -> str:
        return self._source[name]

    def dtype(self, name: str) -> str:
        """The stored dtype's safetensors name (I32, F16, F8_E4M3, ...), without reading the data."""
        return self._handles[self._where[name]].get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)


def _is_quantized(t: CheckpointTensors, prefix: str) -> bool:
    """Does this layer's weight sit in the checkpoint as codes (any format) rather than as a float `weight`?"""
    if f"{prefix}.qweight" in t or f"{prefix}.weight_packed" in t:
        return True
    return f"{prefix}.weight" in t and t.dtype(f"{prefix}.weight") in ("I8", "F8_E4M3", "F8_E5M2")


def _read_int(t: CheckpointTensors, scheme: PrequantScheme, prefix: str) -> IntWeights | None:
    """A quantized layer's integer weights; None for FP8 (no integer codes)."""
    if scheme.method == "gptq":
        return read_gptq(t, prefix, scheme.bits, scheme.gptq_v1)
    if scheme.method == "awq":
        return read_awq(t, prefix)
    if f"{prefix}.weight" in t and t.dtype(f"{prefix}.weight").startswith("F8"):
        return None
    return read_compressed_int(t, prefix)


def dequantized(t: CheckpointTensors, scheme: PrequantScheme, prefix: str) -> torch.Tensor:
    """A quantized layer's weight as float32 [N, K] (the reference every path is compared with)."""
    w = _read_int(t, scheme, prefix)
    return read_fp8(t, prefix, scheme.fp8_block) if w is None else dequantize_int(w)


def _parts(net: nn.Module, name: str) -> list[str]:
    """The checkpoint layers a model linear is filled from, in row order (fused q/k/v, gate/up: the model's FUSED)."""
    fused = getattr(net, "FUSED", {})
    head, _, last = name.rpartition(".")
    parts = sorted((shard, f"{head}.{frag}") for frag, (target, shard) in fused.items() if target == last)
    return [p for _, p in parts] or [name]


def keep_prequantized(net: nn.Module, t: CheckpointTensors, scheme: PrequantScheme) -> set[str]:
    """Swap each linear whose checkpoint codes fit a kernel layout for a GGUFLinear over them; the names consumed."""
    consumed: set[str] = set()
    tied = getattr(net.config, "tie_word_embeddings", False)
    for name, module in list(net.named_modules()):
        if not isinstance(module, nn.Linear) or tied and name == "lm_head":
            continue
        parts = _parts(net, name)
        if not all(_is_quantized(t, p) for p in parts):
            continue
        blocks = [kernel_blocks(w) if (w := _read_int(t, scheme, p)) is not None else None for p in parts]
        if any(b is None for b in blocks) or len({b.kind for b in blocks}) > 1:
            continue  # dequantized to float by `dequantized_rest`
        parent, _, attr = name.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, attr,
                GGUFLinear(concat(blocks), module.in_features, module.bias))
        consumed |= {f"{p}.{s}" for p in parts for s in QUANT_SUFFIXES} & set(t.names())
    log.info("%s: %d of %d quantized linear layers run on the int kernels", scheme.summary,
             len({n.rpartition(".")[0] for n in consumed}), len(quantized_layers(t)))
    return consumed


HALF_STORED = {"BF16": torch.bfloat16, "F16": torch.float16}
TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def _half_tables(t: CheckpointTensors, hook) -> dict[str, str]:
    """The model's table names (TABLES) -> the checkpoint tensor that fills each as it is stored, in bf16 / fp16
    (a family hook that renames it counts; one that changes its values does not: that one is loaded as float)."""
    found = {}
    for name in t.names():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) and t.dtype(name) in HALF_STORED:
            probe = torch.empty(0, device="meta")
            found |= {new: name for new, out, _ in hook(name, probe) if new in TABLES and out is probe}
    return found


def keep_half_tables(net: nn.Module, t: CheckpointTensors, hook) -> set[str]:
    """Swap the float LM head and token table for HalfLinear / HalfEmbedding over the checkpoint's own bfloat16 or
    float16 tensors (hook: name, tensor -> the loader's (name, tensor, source) for it: the family's renames); the
    checkpoint names consumed. Float32 tables stay
    float32; `net`'s float tables must not have been written (their pages are never committed)."""
    found = _half_tables(t, hook)
    embed, vocab = found.get(TABLES[0]), net.config.vocab_size
    shape = (vocab, net.config.hidden_size)
    if embed is None or tuple(t.get(embed).shape) != shape:
        return set()
    table = t.get(embed)  # [vocab, hidden] in its stored dtype, memory-mapped
    if net.config.tie_word_embeddings:
        net.model.embed_tokens, net.lm_head = tied_half(table)
        return {embed} | ({found[TABLES[1]]} if TABLES[1] in found else set())
    net.model.embed_tokens = HalfEmbedding(vocab, table.clone())  # a copy: the memory map is released later
    head = found.get(TABLES[1])
    if head is None or tuple(t.get(head).shape) != shape or not isinstance(net.lm_head, nn.Linear) \
            or net.lm_head.bias is not None:
        return {embed}
    net.lm_head = HalfLinear(t.get(head))
    return {embed, head}


def quantized_layers(t: CheckpointTensors) -> set[str]:
    """The checkpoint's layer prefixes whose weights are stored quantized."""
    return {n.rpartition(".")[0] for n in t.names()
            if n.endswith((".qweight", ".weight_packed", ".weight")) and _is_quantized(t, n.rpartition(".")[0])}


def dequantized_rest(t: CheckpointTensors, scheme: PrequantScheme, consumed: set[str],
                     shard: TPShard | None) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name, tensor, file) for the loader: everything not consumed, quantized layers as float `weight`s."""
    quantized = quantized_layers(t)
    for name in t.names():
        prefix, _, suffix = name.rpartition(".")
        source = t.source(name)
        if name in consumed or scheme.kv_scales and suffix in KV_SCALES:
            continue
        if prefix not in quantized or suffix not in QUANT_SUFFIXES:
            tensor = t.get(name)
        elif suffix in ("qweight", "weight_packed", "weight"):  # the codes: one float weight for the layer
            name, tensor = f"{prefix}.weight", dequantized(t, scheme, prefix)
        else:
            continue  # scales, zeros, shapes: read with their layer's codes
        yield name, tensor if shard is None or shard.world_size == 1 else take_shard(name, tensor, shard), source
