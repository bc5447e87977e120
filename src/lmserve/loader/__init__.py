"""Checkpoint loading: a path (GGUF file or HF directory) -> a built model with its weights in place, untransformed
(weight formats, tensor parallelism and the rest are the worker's pipeline: worker/transforms.py).

The logic lives in named modules; this file only re-exports what callers name, each on first use (PEP 562). Why
lazily: importing any submodule runs this file first, and an eager `model_loader` import here pulled torch into
the torch-free ones (hf_hub, default_model, gguf_file), so `lmserve list` and `lmserve pull` imported torch for
nothing (3.4-3.7 s of each on a first-generation Zen, against ~0.7 s for the whole command without it)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from lmserve.errors import CheckpointError

_HOMES = {"read_model_config": "checkpoint", "resolve_model_path": "header", "default_model_path": "default_model",
          "LoadedModel": "model_loader", "load_model": "model_loader"}

if TYPE_CHECKING:
    from lmserve.loader.checkpoint import read_model_config
    from lmserve.loader.default_model import default_model_path
    from lmserve.loader.header import resolve_model_path
    from lmserve.loader.model_loader import LoadedModel, load_model


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


__all__ = ["CheckpointError", "LoadedModel", "default_model_path", "load_model", "read_model_config",
           "resolve_model_path"]
