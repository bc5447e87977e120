"""The serve flags that name models: `--model [NAME=]PATH` (repeatable), `--route`, `--max-loaded-models`,
`--keep-alive`, `--keep-alive-max`, `--allow-unload`.

Every model is checked at start (its header read, its KV pool sized by the same arithmetic as the engine) before
anything loads; a mistake is one ConfigError naming the flag. No torch at import: `lmserve serve` runs the checks
that need none (check_model_flags) before it imports torch (server/first_checks.py).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from lmserve.config import EngineConfig, engine_config
from lmserve.errors import ConfigError
from lmserve.loader.header import check_before_torch
from lmserve.server.models.pool import KeepAlive, ModelSpec
from lmserve.server.models.traffic import TrafficSplit, parse_split, valid_name

# A quantization tag at the end of a GGUF file's stem: "SmolLM2-135M-Instruct.Q4_1", "Llama-3.2-1B-Q4_K_M".
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|BF16|F16|F32)$", re.IGNORECASE)


def served_name(args: argparse.Namespace, model_path: Path) -> str:
    """--served-model-name; else a Hub id as given (as vLLM); else the model file's stem without its quantization
    tag, or the directory's name."""
    from lmserve.loader.hf_hub import looks_like_hub_id

    if args.served_model_name:
        return args.served_model_name
    if args.model is not None and looks_like_hub_id(args.model):
        return args.model
    return _QUANT_SUFFIX.sub("", model_path.stem) if model_path.is_file() else model_path.name


def split_entry(text: str | None) -> tuple[str | None, str | None]:
    """`NAME=PATH` -> (NAME, PATH); a plain PATH (or Hub id) -> (None, PATH). A '/' before the '=' means a path."""
    if text is None:
        return None, None
    name, sep, path = text.partition("=")
    if sep and "/" not in name and valid_name(name) and path:
        return name, path
    return None, text


def check_model_flags(args: argparse.Namespace) -> list[tuple[str, EngineConfig]]:
    """The model flags' checks that need no torch, every --model in turn (its numbers, its path, its header file),
    then the names and the pool's own flags: (served name, engine config with the model as a local path) per model,
    the first the default. They run before torch is imported (server/first_checks.py); model_specs goes on from
    their result.
    """
    entries = [split_entry(e) for e in (args.model or [None])]
    if len(entries) > 1 and args.served_model_name:
        raise ConfigError("--served-model-name names the one model; with several --model, use --model NAME=PATH")
    models = []
    for name, path in entries:
        one = argparse.Namespace(**{**vars(args), "model": path})
        cfg = check_before_torch(engine_config(one))  # the model as a local path: a Hub id resolved here, once
        models.append((name or served_name(one, Path(cfg.model)), cfg))
    names = [n for n, _ in models]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--model: the served name {twice[0]!r} is given twice (use --model NAME=PATH)")
    if args.max_loaded_models is not None and args.max_loaded_models < 1:
        raise ConfigError(f"--max-loaded-models must be >= 1, got {args.max_loaded_models}")
    if not args.model_load_timeout > 0:
        raise ConfigError(f"--model-load-timeout must be > 0 seconds, got {args.model_load_timeout}")
    return models


def model_specs(models: list[tuple[str, EngineConfig]]) -> list[ModelSpec]:
    """One checked ModelSpec per model of check_model_flags (the embedded model when no --model is given); the
    first is the default.

    `--kv-cache-memory` and every other engine flag apply to each model alone: each has its own KV pool of that
    size (a fraction is of the memory available when that model loads).
    """
    from lmserve.preflight import check_engine_config  # torch: only after check_model_flags (see there)

    specs = []
    for name, cfg in models:
        checked = check_engine_config(cfg)
        specs.append(ModelSpec(name, checked.config, checked.config.max_model_len, checked.model_config))
    return specs


def keep_alive(args: argparse.Namespace) -> KeepAlive:
    """--keep-alive, --keep-alive-max (default: --keep-alive's value) and --allow-unload; ConfigError naming the
    flag. A request may lengthen the keep-alive only as far as the operator says (by default not at all)."""
    default = _duration(args, "keep_alive")
    longest = _duration(args, "keep_alive_max") if getattr(args, "keep_alive_max", None) is not None else default
    if longest is not None and (default is None or longest < default):
        raise ConfigError(f"--keep-alive-max {args.keep_alive_max} is shorter than --keep-alive "
                          f"({args.keep_alive if default is not None else 'unset: models stay loaded'})")
    return KeepAlive(default, longest, bool(getattr(args, "allow_unload", False)))


def _duration(args: argparse.Namespace, name: str) -> float | None:
    """A duration flag in seconds (None: never unload); ConfigError naming the flag."""
    from lmserve.units import parse_duration

    text = getattr(args, name, None)  # a Namespace built by hand (Ray, tests) may lack it
    if text is None:
        return None
    try:
        return parse_duration(text)
    except ValueError as e:
        raise ConfigError(f"--{name.replace('_', '-')}: {e}") from None


def traffic_splits(args: argparse.Namespace, model_names: list[str]) -> dict[str, TrafficSplit]:
    """--route NAME=MODEL:WEIGHT,... by name; each target a served model, no name a model's or another route's."""
    splits: dict[str, TrafficSplit] = {}
    for text in args.route or []:
        try:
            split = parse_split(text)
        except ValueError as e:
            raise ConfigError(f"--route: {e}") from None
        unknown = [m for m, _ in split.targets if m not in model_names]
        if unknown:
            raise ConfigError(f"--route {split.name}: {unknown[0]!r} is not a served model "
                              f"(served: {', '.join(model_names)})")
        if split.name in model_names or split.name in splits:
            raise ConfigError(f"--route: the name {split.name!r} is already a model's or another route's")
        splits[split.name] = split
    return splits
