"""Read and validate a PEFT LoRA adapter directory into plain tensors, knowing nothing of the engine.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` (PEFT's
`save_pretrained`). Every tensor's shape is checked against the base model's `ModelConfig`, so an
adapter trained for another base is refused here, before any engine sees it. Each refusal is one
`AdapterError` whose message names the file, field or tensor at fault.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from lmserve.files import MAX_JSON_FILE_DEPTH, nests_deeper
from lmserve.models.config import ModelConfig

log = logging.getLogger(__name__)

# HF projection name -> the decoder sub-module it lives in.
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Config fields that change what the adapter computes beyond W + s * B @ A: refused when set.
_UNSUPPORTED_FIELDS = {
    "modules_to_save": "modules_to_save (fully trained copies of base modules)",
    "use_dora": "use_dora (DoRA)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "trainable_token_indices": "trainable_token_indices (embedding updates)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters (LoRA on raw parameters)",
    "fan_in_fan_out": "fan_in_fan_out (transposed, Conv1D-style weights)",
}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_TENSOR_RE = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be used with this base model; the message names the problem (a 400 when served)."""


@dataclass(frozen=True)
class LoraModule:
    """One adapted projection: its output gains `scaling * (x @ a.T) @ b.T`."""

    a: torch.Tensor  # [rank, in_features] float32 (PEFT's lora_A.weight)
    b: torch.Tensor  # [out_features, rank] float32 (PEFT's lora_B.weight)
    scaling: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with use_rslora

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def delta(self) -> torch.Tensor:
        """The dense weight update `scaling * b @ a`, [out_features, in_features] float32."""
        return (self.b @ self.a) * self.scaling


@dataclass(frozen=True)
class PeftAdapter:
    """A validated adapter: float32 A/B per (decoder layer index, HF projection name)."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    target_modules: tuple[str, ...]  # HF projection names present, sorted
    modules: dict[tuple[int, str], LoraModule]
    digest: str = ""  # SHA-256 of the files' bytes as read (AdapterFiles.digest): what answers, not its name

    @property
    def nbytes(self) -> int:
        """Bytes of all A and B tensors."""
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())

    def largest_slot_value(self) -> float:
        """The largest magnitude a device slot would hold: of every A, and every B with its scaling folded in."""
        return max(max(m.a.abs().max().item(), m.b.abs().max().item() * m.scaling) for m in self.modules.values())


def read_peft_adapter(path: str | os.PathLike, cfg: ModelConfig, *, name: str, max_rank: int = 64,
                      root: str | os.PathLike | None = None) -> PeftAdapter:
    """Read the PEFT adapter directory `path`, checked against the base `cfg`; AdapterError on any problem.

    `root`: the directory the adapter must stay inside (a runtime load: the --lora-dir subdirectory its key may
    load from). Every file read is then resolved after it is opened and must lie inside `root` (a symlink out is
    refused), and errors name paths relative to it (the directory's own name when it is `root`).
    Errors never quote a file's contents or a config value, only field and tensor names this code built.
    """
    files = AdapterFiles(Path(path), None if root is None else Path(root))
    config = _read_config(files)
    tensors = _read_tensors(files)
    pairs = _group_pairs(tensors)
    modules: dict[tuple[int, str], LoraModule] = {}
    for (layer, proj), (a, b) in sorted(pairs.items()):
        key = f"model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
        rank, alpha = _rank_alpha(config, key)
        _check_shapes(key, a, b, layer, proj, rank, cfg)
        if rank > max_rank:
            raise AdapterError(f"adapter {files.shown}: rank {rank} of {key} ({CONFIG_FILE}) is above the maximum "
                               f"LoRA rank {max_rank} (raise --max-lora-rank)")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules[(layer, proj)] = LoraModule(a=a, b=b, scaling=float(scale))
    if not modules:
        raise AdapterError(f"adapter {files.shown}: {WEIGHTS_FILE} holds no LoRA tensors")
    return PeftAdapter(name=name, path=str(files.dir), rank=max(m.rank for m in modules.values()),
                       target_modules=tuple(sorted({proj for _, proj in modules})), modules=modules,
                       digest=files.digest())


class AdapterFiles:
    """The files of one adapter directory, read whole (each once) and hashed as read.

    The digest is of exactly the bytes parsed, so it names what will answer: two reads with one digest hold
    the same weights, and a file changed between a check and its read cannot slip past.
    """

    def __init__(self, directory: Path, root: Path | None) -> None:
        self.dir, self.root = directory, root
        self.shown = _relative(directory, root) if root is not None else str(directory)  # for messages
        self._hash = hashlib.sha256()

    def read(self, filename: str) -> bytes:
        """The bytes of `filename` in the directory; outside `root` once resolved is an AdapterError."""
        file = self.dir / filename
        if self.root is not None and not _inside(file.resolve(), self.root):  # refused before it is opened
            raise self._outside(filename)
        try:  # NONBLOCK: a FIFO planted here must not hang the read
            fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise AdapterError(f"adapter {self.shown}: {filename} cannot be opened ({e.strerror})") from None
        try:
            if self.root is not None and not _inside(_opened_path(fd, file), self.root):  # swapped meanwhile
                raise self._outside(filename)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise AdapterError(f"adapter {self.shown}: {filename} is not a regular file")
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read()
        finally:
            os.close(fd)
        self._hash.update(b"%s %d\n" % (filename.encode(), len(data)))
        self._hash.update(data)
        return data

    def digest(self) -> str:
        """SHA-256 (hex) of every file read, in order, each with its name and length."""
        return self._hash.hexdigest()

    def _outside(self, filename: str) -> AdapterError:
        return AdapterError(f"adapter {self.shown}: {filename} leads outside --lora-dir, or the "
                            "subdirectory its key may load from (a symlink out); refused")


def _relative(path: Path, root: Path) -> str:
    """`path` as the --lora-dir-relative name errors show (never the server's absolute path)."""
    try:
        relative = path.relative_to(root)
    except ValueError:
        return path.name
    return path.name if relative == Path(".") else str(relative)


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def _opened_path(fd: int, file: Path) -> Path:
    """Where an open file really is: Linux names it in /proc; elsewhere resolve the path again."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return file.resolve()


def _read_config(files: AdapterFiles) -> dict[str, Any]:
    """adapter_config.json, parsed, with every unsupported feature refused by name (never by its value)."""
    shown, where = files.shown, f"adapter {files.shown}: {CONFIG_FILE}"
    if not files.dir.is_dir():
        raise AdapterError(f"adapter {shown}: not a directory (expected a PEFT adapter directory with {CONFIG_FILE})")
    if not (files.dir / CONFIG_FILE).is_file():
        raise AdapterError(f"adapter {shown}: {CONFIG_FILE} is missing")
    raw = files.read(CONFIG_FILE)
    if nests_deeper(raw):  # json.loads recurses per level: 200,000 levels were a RecursionError
        raise AdapterError(f"{where} is nested more than {MAX_JSON_FILE_DEPTH} levels deep")
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise AdapterError(f"{where} is not valid JSON (line {e.lineno}, column {e.colno})") from None
    except UnicodeDecodeError:
        raise AdapterError(f"{where} is not UTF-8 text") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{where} must hold a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{where}: this peft_type is not supported (only LORA)")
    for field, what in _UNSUPPORTED_FIELDS.items():
        if config.get(field):
            raise AdapterError(f"{where}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: this bias is not supported (only 'none')")
    _check_targets(where, config.get("target_modules"))
    for field in ("rank_pattern", "alpha_pattern"):
        _check_patterns(where, field, config.get(field))
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise AdapterError(f"{where}: {field} must be a positive number")
    return config


def _check_targets(where: str, targets: Any) -> None:
    """A list of target names must stay within the seven projections (a regex string is checked by tensor names)."""
    if not isinstance(targets, (list, tuple)):
        return
    for i, target in enumerate(targets):
        leaf = str(target).rsplit(".", 1)[-1]
        if leaf in ("embed_tokens", "lm_head"):  # one of two known names: safe to say which
            raise AdapterError(f"{where}: LoRA on {leaf} (embedding/LM head) is not supported")
        if leaf not in PROJECTIONS:
            raise AdapterError(f"{where}: target_modules[{i}] is not supported (supported: {', '.join(PROJECTIONS)})")


def _check_patterns(where: str, field: str, patterns: Any) -> None:
    """rank_pattern / alpha_pattern: an object of regular expressions (PEFT matches them against module names)."""
    if patterns is None:
        return
    if not isinstance(patterns, dict):
        raise AdapterError(f"{where}: {field} must be an object of pattern -> value")
    for i, pattern in enumerate(patterns):
        try:
            re.compile(rf"(.*\.)?({pattern})$")  # as _pattern_value matches it
        except (re.error, RecursionError, OverflowError):  # sre's parser recurses per nested group
            raise AdapterError(f"{where}: {field} key {i} is not a valid regular expression") from None


def _read_tensors(files: AdapterFiles) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors, every tensor as float32; a pickle-only adapter is refused."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    where = f"adapter {files.shown}: {WEIGHTS_FILE}"
    if not (files.dir / WEIGHTS_FILE).is_file():
        if (files.dir / "adapter_model.bin").exists():
            raise AdapterError(f"adapter {files.shown}: only a pickle adapter_model.bin is present; pickle is refused, "
                               f"save the adapter as {WEIGHTS_FILE} (PEFT: save_pretrained(safe_serialization=True))")
        raise AdapterError(f"adapter {files.shown}: {WEIGHTS_FILE} is missing")
    data = files.read(WEIGHTS_FILE)
    try:
        tensors = load(data)
    except (SafetensorError, ValueError) as e:
        log.warning("%s: %s", where, e)  # the details for the operator; the client hears only that it failed
        raise AdapterError(f"{where} cannot be read as safetensors") from None
    for key, t in tensors.items():
        if not t.is_floating_point():
            raise AdapterError(f"{where}: a tensor has dtype {t.dtype}, expected a float type")
    return {k: t.to(torch.float32).contiguous() for k, t in tensors.items()}


def _group_pairs(tensors: Mapping[str, torch.Tensor]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Tensor names -> {(layer, projection): (A, B)}; names outside the seven projections are refused."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _TENSOR_RE.match(key)
        if m is None or PROJECTIONS.get(m.group(3)) != m.group(2):  # its name is file content: logged, not quoted
            log.warning("adapter %s: refused tensor %r", WEIGHTS_FILE, key[:200])
            raise AdapterError(f"adapter {WEIGHTS_FILE}: a tensor is refused: {_unknown_reason(key)}")
        halves.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = t
    for (layer, proj), pair in halves.items():
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(f"adapter {WEIGHTS_FILE}: model.layers.{layer}.{PROJECTIONS[proj]}.{proj} has no "
                              f"{missing}.weight")
    return {k: (v["A"], v["B"]) for k, v in halves.items()}


def _unknown_reason(key: str) -> str:
    if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
        return "LoRA on the embedding/LM head is not supported"
    if "lora_magnitude_vector" in key:
        return "DoRA (use_dora) is not supported"
    if key.endswith("lora_B.bias"):
        return "lora_bias is not supported"
    return f"unknown tensor name (expected LoRA A/B weights of {', '.join(PROJECTIONS)})"


def _pattern_value(patterns: Mapping[str, Any], key: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern lookup: the first pattern that matches the end of the module name."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _rank_alpha(config: Mapping[str, Any], key: str) -> tuple[int, float]:
    """This module's rank and lora_alpha after rank_pattern/alpha_pattern."""
    rank = _pattern_value(config.get("rank_pattern") or {}, key, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, key, config["lora_alpha"])
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"adapter {CONFIG_FILE}: rank of {key} (r, rank_pattern) must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
        raise AdapterError(f"adapter {CONFIG_FILE}: lora_alpha of {key} (alpha_pattern) must be a positive number")
    return rank, float(alpha)


def expected_shapes(proj: str, rank: int, cfg: ModelConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """(A shape, B shape) of a rank-`rank` LoRA on `proj` of this base."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    in_out = {"q_proj": (h, cfg.q_size), "k_proj": (h, cfg.kv_size), "v_proj": (h, cfg.kv_size),
              "o_proj": (cfg.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[proj]
    return (rank, in_out[0]), (in_out[1], rank)


def _check_shapes(key: str, a: torch.Tensor, b: torch.Tensor, layer: int, proj: str, rank: int,
                  cfg: ModelConfig) -> None:
    """Both tensors' shapes against the base model; the message names the tensor and both shapes."""
    if layer >= cfg.num_layers:
        raise AdapterError(f"adapter {WEIGHTS_FILE}: tensor {key}.lora_A.weight: layer {layer} does not exist "
                           f"(the base model has {cfg.num_layers} layers)")
    if PROJECTIONS[proj] == "mlp" and cfg.is_moe_layer(layer):
        raise AdapterError(f"adapter {WEIGHTS_FILE}: tensor {key}.lora_A.weight: layer {layer} is a mixture of "
                           "experts; LoRA on experts is not supported (target the attention projections)")
    want_a, want_b = expected_shapes(proj, rank, cfg)
    for half, t, want in (("lora_A", a, want_a), ("lora_B", b, want_b)):
        if tuple(t.shape) != want:
            raise AdapterError(f"adapter {WEIGHTS_FILE}: tensor {key}.{half}.weight has shape {list(t.shape)}, but "
                               f"the base model needs {list(want)} (an adapter for another base model, or a wrong "
                               "rank)")
