"""Which checkpoint, and what its header says: a model name -> a path, a path -> its ModelConfig and quantization
scheme, checked before any weight is read (a bad checkpoint is refused before anything starts)."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

from lmserve.errors import CheckpointError
from lmserve.loader.default_model import default_model_path
from lmserve.loader.gguf_file import read_gguf
from lmserve.loader.gguf_loader import gguf_config
from lmserve.loader.hf_hub import download_snapshot, looks_like_hub_id
from lmserve.loader.mmproj import read_mmproj, vision_model_config
from lmserve.loader.prequant import PrequantScheme, read_scheme
from lmserve.loader.safetensors_loader import read_config, weight_files
from lmserve.models.config import ModelConfig
from lmserve.models.config_hf import config_from_hf


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


def read_model_config(path: Path, mmproj: str | Path | None = None) -> ModelConfig:
    """The model's hyperparameters from its header alone (GGUF metadata or config.json): no weights are read;
    with `mmproj` (a text GGUF's projector file) the vision family's, the projector checked against the text model.

    Raises the CheckpointError load_model would, so a bad checkpoint is refused before anything starts.
    """
    if mmproj is not None:
        if path.is_dir() or path.suffix.lower() != ".gguf":
            raise CheckpointError(f"--mmproj goes with a text .gguf file; {path} is not one (a Hugging Face "
                                  "directory carries its own vision tower)")
        text = gguf_config(read_gguf(path))
        return vision_model_config(text, read_mmproj(mmproj, text))
    if path.is_dir():
        cfg = config_from_dir(path)
        scheme_of(path)  # a refused quantization_config fails here too
        weight_files(path)  # a directory without weights fails here, not after the server is up
        return cfg
    if path.suffix.lower() == ".gguf":
        return gguf_config(read_gguf(path))
    refuse_format(path)


def refuse_format(path: Path) -> NoReturn:
    """Neither a GGUF file nor a Hugging Face directory: say what is loaded instead (never a pickle)."""
    if path.suffix.lower() in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
        raise CheckpointError(f"{path}: pickle checkpoints are not loaded (unpickling can run arbitrary code); "
                              "convert the model to safetensors")
    raise CheckpointError(f"{path}: expected a .gguf file or a Hugging Face directory with config.json")


def scheme_of(path: Path) -> PrequantScheme | None:
    """A directory's checked quantization_config (None: float weights), refusals naming config.json."""
    try:
        return read_scheme(read_config(path))
    except CheckpointError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None


def config_from_dir(path: Path) -> ModelConfig:
    """A Hugging Face directory's normalised ModelConfig, refusals naming config.json."""
    raw = read_config(path)  # its errors name the file already
    try:
        return config_from_hf(raw)
    except CheckpointError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
