"""The pooling method of an embedding checkpoint: sentence-transformers' files when present, else `--pooling`.

A sentence-transformers directory lists its modules in `modules.json`; its `Pooling` module's folder (usually
`1_Pooling/`) holds `config.json` with one `pooling_mode_*` flag set. We run CLS (first token), mean (over the
prompt), max (per dimension) and last-token. `--pooling` overrides the files (as vLLM's pooler override does);
without either, last-token pooling for a decoder LM and CLS for an encoder (vLLM's defaults). A `Normalize` module
says the checkpoint's vectors are unit length; `sentence_bert_config.json`'s max_seq_length is its window. A
classification head pools CLS. A GGUF file says its pooling in `{arch}.pooling_type` (llama.cpp's converter reads
it from the same sentence-transformers files) and nothing about normalising: its vectors are made unit length,
as llama-server's `--embd-normalize` default does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from lmserve.errors import CheckpointError
from lmserve.files import load_json_bytes
from lmserve.pooling_params import DEFAULT_POOLING, PoolerConfig

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last",
          "pooling_mode_max_tokens": "max"}
_UNSUPPORTED = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
# an encoder without sentence-transformers files pools its first token (vLLM's default for BERT-like models), as
# does a classification head (BERT's pooler and XLM-R's head read the CLS vector)
ENCODER_POOLING = "cls"


# llama.cpp's pooling_type values (gguf's PoolingType: 0 none, 4 rank: a classifier's head, read as num_labels)
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def pooler_config(model_path: Path, flag: str | None, encoder: bool = False, num_labels: int = 0,
                  gguf_meta: Mapping[str, Any] | None = None) -> PoolerConfig:
    """The model's pooling: its method as `pooler_method` finds it; whether its checkpoint normalises
    (a `Normalize` module); its sentence-transformers window; for an encoder, its head's labels. `gguf_meta`: a GGUF
    file's metadata, which says the pooling in place of sentence-transformers' files."""
    root = model_path if model_path.is_dir() else model_path.parent
    if gguf_meta is not None and not num_labels:
        return gguf_pooler(gguf_meta, flag, encoder)
    if num_labels:  # a classification head reads the CLS vector, whatever else the files say
        labels = _labels(root, num_labels) if gguf_meta is None else _gguf_labels(gguf_meta, num_labels)
        return PoolerConfig("cls", "the classification head", False, True, num_labels, labels=labels)
    base = pooler_method(model_path, flag)
    if encoder and base.source.startswith("default"):
        base = PoolerConfig(ENCODER_POOLING, "default for an encoder")
    types = [m.get("type") for m in _modules(root)]
    normalize = _ST_NORMALIZE in types if types else True
    return PoolerConfig(base.method, base.source, normalize, encoder, 0, _max_seq_length(root))


def gguf_pooler(meta: Mapping[str, Any], flag: str | None, encoder: bool) -> PoolerConfig:
    """A GGUF embedder's pooling: `--pooling`, else `{arch}.pooling_type`, else the default; always normalised."""
    key = f"{meta.get('general.architecture')}.pooling_type"
    kind = meta.get(key)
    if flag is not None:
        return PoolerConfig(flag, "--pooling", True, encoder)
    if kind is None or kind == 0:
        return PoolerConfig(ENCODER_POOLING if encoder else DEFAULT_POOLING,
                            f"default ({key} {'is none' if kind == 0 else 'absent'})", True, encoder)
    if kind not in _GGUF_POOLING:
        raise CheckpointError(f"GGUF metadata: {key} {kind!r} is not an embedder's pooling (lmserve reads "
                              "1 mean, 2 cls, 3 last); pass --pooling to choose one")
    return PoolerConfig(_GGUF_POOLING[kind], key, True, encoder)


def _gguf_labels(meta: Mapping[str, Any], n: int) -> tuple[str, ...]:
    """A GGUF's `{arch}.classifier.output_labels` by index (LABEL_i where it has none), never a config.json that
    happens to lie beside the file."""
    names = meta.get(f"{meta.get('general.architecture')}.classifier.output_labels")
    names = list(names) if isinstance(names, (list, tuple)) and len(names) == n else []
    return tuple(str(names[i]) if names else f"LABEL_{i}" for i in range(n))


def _labels(root: Path, n: int) -> tuple[str, ...]:
    """config.json's id2label names by index (transformers' LABEL_i where it has none)."""
    try:
        names = load_json_bytes((root / "config.json").read_bytes()).get("id2label") or {}
    except (OSError, ValueError, AttributeError):
        names = {}
    return tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) if isinstance(names, dict) else f"LABEL_{i}"
                 for i in range(n))


def _modules(root: Path) -> list[dict]:
    """modules.json's entries ([] without one, or one that is not a list of objects)."""
    try:
        entries = load_json_bytes((root / "modules.json").read_bytes())
    except (OSError, ValueError):
        return []
    return [m for m in entries if isinstance(m, dict)] if isinstance(entries, list) else []


def _max_seq_length(root: Path) -> int | None:
    """sentence_bert_config.json's max_seq_length: the window sentence-transformers cuts inputs to."""
    try:
        n = load_json_bytes((root / "sentence_bert_config.json").read_bytes()).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def pooler_method(model_path: Path, flag: str | None) -> PoolerConfig:
    """`flag` (--pooling) when given, else what the checkpoint's sentence-transformers files say, else the default."""
    if flag is not None:
        return PoolerConfig(flag, "--pooling")
    root = model_path if model_path.is_dir() else model_path.parent
    modules = root / "modules.json"
    if not modules.is_file():
        return PoolerConfig(DEFAULT_POOLING, "default")
    try:
        entries = load_json_bytes(modules.read_bytes())
        folder = next((m.get("path", "") for m in entries if m.get("type") == _ST_POOLING), None)
        if folder is None:
            return PoolerConfig(DEFAULT_POOLING, "default (modules.json has no Pooling module)")
        cfg = load_json_bytes((root / folder / "config.json").read_bytes())
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise CheckpointError(f"{modules}: cannot read the sentence-transformers pooling config ({e})") from None
    return PoolerConfig(_method(cfg, root / folder / "config.json"), f"{folder}/config.json")


def _method(cfg: dict, where: Path) -> str:
    """The one pooling_mode_* flag set (the others must be off)."""
    bad = [k for k in _UNSUPPORTED if cfg.get(k)]
    if bad:
        raise CheckpointError(f"{where}: {bad[0]} is not supported (lmserve pools cls, mean, max or lasttoken); "
                              "pass --pooling to choose one")
    methods = [m for key, m in _MODES.items() if cfg.get(key)]
    if len(methods) != 1:
        raise CheckpointError(f"{where}: expected exactly one of {', '.join(_MODES)} set, got {len(methods)}")
    return methods[0]
