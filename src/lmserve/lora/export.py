"""Write a base model with LoRA deltas merged in as a Hugging Face safetensors directory.

The base streams tensor by tensor (GGUF: dequantized to float32, llama.cpp's Q/K order undone;
safetensors: memory-mapped), each adapted projection gets `W + scaling * B @ A` in float32, and the
result is cast to the export dtype and written in shards. QLoRA path: with `quantization`, each
projection weight first goes through lmserve's own weight-only quantizer and back (the 4-bit codes a
`--quantization int4` server would use), so the delta lands on the weights that quantized serving
sees; embeddings, norms and the LM head stay as stored. A GGUF base needs a config.json written from
its metadata (here) and a tokenizer (tokenizer/tokenizer.py, called by the CLI).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from safetensors.torch import save_file

from lmserve.errors import CheckpointError, ConfigError
from lmserve.layers.formats.quantized import INT4_GROUP, dequantize_int4, quantize_int4, quantize_int8
from lmserve.loader.gguf_file import read_gguf
from lmserve.loader.gguf_loader import gguf_config, iter_gguf
from lmserve.loader.header import read_config
from lmserve.loader.safetensors_loader import INDEX_FILE, iter_safetensors, weight_files
from lmserve.lora.peft_adapter import LoraModule
from lmserve.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files of a Hugging Face directory that describe the tokenizer and generation: copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json", "added_tokens.json",
                   "vocab.json", "merges.txt")
_HF_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
_PROJ_RE = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|"
                      r"down_proj)\.weight$")


@dataclass(frozen=True)
class ExportResult:
    """What was written: the files, how many projections took a delta, and the bytes of weights."""

    files: tuple[str, ...]
    merged_modules: int
    nbytes: int


def export_merged(base: Path, cfg: ModelConfig, modules: Mapping[tuple[int, str], LoraModule], out: Path,
                  dtype: torch.dtype, quantization: str | None = None,
                  max_shard_bytes: int = 4 * 2**30) -> ExportResult:
    """Write `base` with `modules` merged into `out` (weights, config.json; a directory base's tokenizer files)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty directory")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _write(base, cfg, modules, out, dtype, quantization, max_shard_bytes)
    except BaseException:  # no half-written model left behind: the directory was empty (or absent) before
        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        if created:
            out.rmdir()
        raise


def _write(base: Path, cfg: ModelConfig, modules: Mapping[tuple[int, str], LoraModule], out: Path,
           dtype: torch.dtype, quantization: str | None, max_shard_bytes: int) -> ExportResult:
    writer = _ShardWriter(out, max_shard_bytes)
    merged: set[tuple[int, str]] = set()
    for name, tensor in _base_tensors(base, cfg):
        m = _PROJ_RE.match(name)
        if m:
            key = (int(m.group(1)), m.group(2))
            tensor = _merged_weight(tensor, modules.get(key), quantization)
            if key in modules:
                merged.add(key)
        writer.add(name, tensor.to(dtype).contiguous())
    missing = sorted(set(modules) - merged)
    if missing:
        raise CheckpointError(f"{base}: the adapter adapts {len(missing)} projection(s) the base has no weight for, "
                              f"e.g. layer {missing[0][0]} {missing[0][1]}")
    files = writer.finish()
    (out / "config.json").write_text(json.dumps(hf_config(base, cfg, dtype), indent=2) + "\n")
    if base.is_dir():
        for name in TOKENIZER_FILES:
            if (base / name).is_file():
                shutil.copyfile(base / name, out / name)
    return ExportResult(tuple(files), len(merged), writer.nbytes)


def _merged_weight(w: torch.Tensor, module: LoraModule | None, quantization: str | None) -> torch.Tensor:
    """float32 W (after the quantizer round trip, if any) plus the adapter's delta."""
    w = w.to(torch.float32)
    if quantization:
        w = round_trip(w, quantization)
    return w if module is None else w + module.delta()


def round_trip(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """float32 W as lmserve's weight-only quantizer stores it, dequantized (a shape int4 cannot pack: W)."""
    if scheme == "int8":
        q, scale = quantize_int8(w)
        return q.float() * scale[:, None]
    if scheme == "int4":
        if w.shape[1] % INT4_GROUP or w.shape[0] % 16:  # layers/quantized.int4_supported: stays float there too
            return w
        return dequantize_int4(*quantize_int4(w))
    raise ConfigError(f"--quantization {scheme!r}: choose int4 or int8")


def _base_tensors(base: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight of the base, one at a time."""
    if base.is_dir():
        files, weight_map = weight_files(base)
        for name, tensor, _ in iter_safetensors(files, weight_map):
            if "rotary_emb.inv_freq" not in name:  # a buffer, recomputed from the config by every loader
                yield name, tensor
        return
    gguf = read_gguf(base)
    if any(t.name == "rope_freqs.weight" for t in gguf.tensors):
        raise CheckpointError(f"{base}: rope frequency factors (rope_freqs.weight, Llama 3.1 GGUFs) cannot be "
                              "written to a config.json yet; merge onto the Hugging Face checkpoint instead")
    for name, tensor, _ in iter_gguf(gguf, gguf_config(gguf)):
        yield name, tensor


def hf_config(base: Path, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json of the export: the base's own (directory), or one written from GGUF metadata."""
    dtype_name = str(dtype).removeprefix("torch.")
    if base.is_dir():
        config = read_config(base)
        arch = next(iter(config.get("architectures") or []), None)
        config.setdefault("model_type", _MODEL_TYPES.get(arch, ""))
        config.pop("dtype", None)  # transformers 5 writes `dtype`; torch_dtype is read by both 4.x and 5
        return {**config, "torch_dtype": dtype_name}
    return _config_from_model(cfg, dtype_name)


def _config_from_model(cfg: ModelConfig, dtype_name: str) -> dict[str, Any]:
    """A transformers config.json for a GGUF's ModelConfig (so transformers and lmserve read the same model)."""
    if cfg.architecture not in _HF_ARCH:
        raise CheckpointError(f"writing a config.json for a {cfg.architecture!r} GGUF is not supported yet; merge onto "
                              "the model's Hugging Face checkpoint instead")
    arch, model_type = _HF_ARCH[cfg.architecture]
    config: dict[str, Any] = {
        "architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else next(iter(cfg.eos_token_ids), None),
        "torch_dtype": dtype_name,
    }
    if cfg.rope_scaling:
        config["rope_scaling"] = dict(cfg.rope_scaling)
    if model_type == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    else:
        config |= {"use_sliding_window": False}
    return config


class _ShardWriter:
    """Collects tensors into safetensors shards of at most ~max_bytes; names them HF's way at the end."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = self.nbytes = 0
        self.shards: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.pending and self.pending_bytes + tensor.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += tensor.nbytes
        self.nbytes += tensor.nbytes

    def _flush(self) -> None:
        path = self.out / f".shard-{len(self.shards)}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Rename the shards (model.safetensors, or model-0000i-of-0000n + index) and return their names."""
        self._flush()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for (tmp, _), name in zip(self.shards, names):
            tmp.rename(self.out / name)
        if n > 1:
            weight_map = {t: name for (_, tensors), name in zip(self.shards, names) for t in tensors}
            index = {"metadata": {"total_size": self.nbytes}, "weight_map": weight_map}
            (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names
