"""What a checkpoint's header says: a path -> its ModelConfig and quantization scheme, checked before any weight is
read (a bad checkpoint is refused before anything starts). Which file, and reading it: loader/header.py."""

from __future__ import annotations

from pathlib import Path

from lmserve.errors import CheckpointError
from lmserve.loader.gguf_loader import gguf_config
from lmserve.loader.header import read_config, read_header
from lmserve.loader.mmproj import read_mmproj, vision_model_config
from lmserve.loader.prequant import PrequantScheme, read_scheme
from lmserve.loader.safetensors_loader import weight_files
from lmserve.models.config import ModelConfig
from lmserve.models.config_hf import config_from_hf


def read_model_config(path: Path, mmproj: str | Path | None = None) -> ModelConfig:
    """The model's hyperparameters from its header alone (GGUF metadata or config.json): no weights are read;
    with `mmproj` (a text GGUF's projector file) the vision family's, the projector checked against the text model.

    Raises the CheckpointError load_model would, so a bad checkpoint is refused before anything starts.
    """
    header = read_header(path, mmproj)  # the file's own checks, which `lmserve serve` ran before importing torch
    if mmproj is not None:
        text = gguf_config(header)
        return vision_model_config(text, read_mmproj(mmproj, text))
    if isinstance(header, dict):  # a Hugging Face directory's config.json
        cfg = config_from_hf_file(path, header)
        scheme_of(path)  # a refused quantization_config fails here too
        weight_files(path)  # a directory without weights fails here, not after the server is up
        return cfg
    return gguf_config(header)


def scheme_of(path: Path) -> PrequantScheme | None:
    """A directory's checked quantization_config (None: float weights), refusals naming config.json."""
    try:
        return read_scheme(read_config(path))
    except CheckpointError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None


def config_from_dir(path: Path) -> ModelConfig:
    """A Hugging Face directory's normalised ModelConfig, refusals naming config.json."""
    return config_from_hf_file(path, read_config(path))  # read_config's errors name the file already


def config_from_hf_file(path: Path, raw: dict) -> ModelConfig:
    """config_from_hf over the directory's parsed config.json, refusals naming the file."""
    try:
        return config_from_hf(raw)
    except CheckpointError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
