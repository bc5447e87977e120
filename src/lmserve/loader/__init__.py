"""Checkpoint loading: a path (GGUF file or HF directory) -> a built model with its weights in place, untransformed
(weight formats, tensor parallelism and the rest are the worker's pipeline: worker/transforms.py).

The logic lives in named modules; this file only re-exports what callers name."""

from lmserve.errors import CheckpointError
from lmserve.loader.checkpoint import read_model_config, resolve_model_path
from lmserve.loader.default_model import default_model_path
from lmserve.loader.model_loader import LoadedModel, load_model

__all__ = ["CheckpointError", "LoadedModel", "default_model_path", "load_model", "read_model_config",
           "resolve_model_path"]
