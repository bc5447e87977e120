"""The pooling method of an embedding checkpoint: sentence-transformers' files when present, else `--pooling`.

A sentence-transformers directory lists its modules in `modules.json`; its `Pooling` module's folder (usually
`1_Pooling/`) holds `config.json` with one `pooling_mode_*` flag set. We run the three that a causal LM's hidden
states support: CLS (first token), mean (over the prompt) and last-token. `--pooling` overrides the files (as
vLLM's pooler override does); without either, last-token pooling (vLLM's default for decoder LMs).
"""

from __future__ import annotations

from pathlib import Path

from lmserve.errors import CheckpointError
from lmserve.files import load_json_bytes
from lmserve.pooling_params import DEFAULT_POOLING, PoolerConfig

_ST_POOLING = "sentence_transformers.models.Pooling"
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def pooler_config(model_path: Path, flag: str | None) -> PoolerConfig:
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
        raise CheckpointError(f"{where}: {bad[0]} is not supported (lmserve pools cls, mean or lasttoken); "
                              "pass --pooling to choose one")
    methods = [m for key, m in _MODES.items() if cfg.get(key)]
    if len(methods) != 1:
        raise CheckpointError(f"{where}: expected exactly one of {', '.join(_MODES)} set, got {len(methods)}")
    return methods[0]
