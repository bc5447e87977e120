"""Which checkpoint, and whether its files can be read, without torch: a model name -> a path, a path -> its header
as parsed from the file (a GGUF file's metadata, a directory's config.json), refused as a load would refuse it.

`check_before_torch` is the first of preflight.py's checks, and `lmserve serve`, `generate` and `chat` run it
before they import torch (server/models/args.py, cli/__init__.py `checked_engine`), so a mistyped path or a file
that is not a model is one line in well under a second, where importing torch alone takes seconds on a small CPU.
loader/checkpoint.py then reads the ModelConfig from the same header (gguf_file.py keeps its last 8 GGUF parses,
so a start, one model or several, parses each of its files once).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from lmserve.config import EngineConfig, check_ranges
from lmserve.errors import CheckpointError, ConfigError
from lmserve.files import read_json_object
from lmserve.loader.default_model import default_model_path
from lmserve.loader.gguf_file import GGUFFile, read_gguf
from lmserve.loader.hf_hub import download_snapshot, looks_like_hub_id

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def resolve_model_path(model: str | Path | None, revision: str | None = None) -> Path:
    """None -> the embedded default; a path that exists -> itself; `org/name` -> its Hugging Face Hub snapshot."""
    if model is None:
        return default_model_path()
    if isinstance(model, str) and looks_like_hub_id(model):
        return download_snapshot(model, revision)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist (pass a .gguf file, a Hugging Face directory "
                                "or a Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct)")
    return path


def model_path(model: str | None, revision: str | None) -> Path:
    """resolve_model_path for a flag's value: a path that is not there (or a Hub id not cached) is a ConfigError."""
    try:
        return resolve_model_path(model, revision)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None


def check_model_files(model: str | None, revision: str | None, mmproj: str | Path | None = None) -> Path:
    """The model flag's checks that need no torch: its path (model_path) and its header file (read_header).
    Returns the path."""
    path = model_path(model, revision)
    read_header(path, mmproj)
    return path


def check_before_torch(cfg: EngineConfig) -> EngineConfig:
    """check_engine_config's first checks, the ones that need no torch, in its order: the flags' numbers
    (config.check_ranges), then the model's path and header file. Returns `cfg` with the model as a local path
    (a Hub id is resolved once)."""
    check_ranges(cfg)
    return replace(cfg, model=str(check_model_files(cfg.model, cfg.revision, cfg.mmproj)))


def read_header(path: Path, mmproj: str | Path | None = None) -> GGUFFile | dict:
    """The model's header as its file holds it: a GGUF file parsed (bounds-checked), or a directory's config.json
    (a JSON object, nesting bounded). With `mmproj` the model must be a text .gguf file. Raises the CheckpointError
    a load would; what the header says (architecture, sizes) is checked later, by checkpoint.read_model_config."""
    if mmproj is not None and (path.is_dir() or path.suffix.lower() != ".gguf"):
        raise CheckpointError(f"--mmproj goes with a text .gguf file; {path} is not one (a Hugging Face "
                              "directory carries its own vision tower)")
    if path.is_dir():
        return read_config(path)
    if path.suffix.lower() == ".gguf":
        return read_gguf(path)
    refuse_format(path)


def read_config(directory: Path) -> dict:
    """Parse config.json, with errors that name it."""
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json (expected a Hugging Face model directory or a .gguf file)")
    try:
        return read_json_object(path)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def refuse_format(path: Path) -> NoReturn:
    """Neither a GGUF file nor a Hugging Face directory: say what is loaded instead (never a pickle)."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: pickle checkpoints are not loaded (unpickling can run arbitrary code); "
                              "convert the model to safetensors")
    raise CheckpointError(f"{path}: expected a .gguf file or a Hugging Face directory with config.json")
