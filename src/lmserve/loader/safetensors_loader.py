"""Hugging Face checkpoint directories: config.json plus one or many memory-mapped safetensors files."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from lmserve.errors import CheckpointError
from lmserve.files import load_json_bytes
from lmserve.loader.header import PICKLE_SUFFIXES
from lmserve.loader.sharding import TPShard, shard_bounds

INDEX_FILE = "model.safetensors.index.json"


def weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read, and the index's tensor -> file map when the checkpoint is sharded."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = _read_index(index)
        return [_inside(directory, name, index) for name in sorted(set(weight_map.values()))], weight_map
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files, None
    pickles = [p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise CheckpointError(
            f"{directory}: only pickle checkpoints found ({', '.join(sorted(pickles)[:3])}). lmserve does not "
            "load pickle files, since unpickling can run arbitrary code; convert the model to safetensors "
            "(e.g. `model.save_pretrained(dir, safe_serialization=True)` in transformers).")
    raise CheckpointError(f"{directory}: no *.safetensors weight files found")


def _read_index(index: Path) -> dict[str, str]:
    try:
        data = load_json_bytes(index.read_bytes())
    except OSError as e:
        raise CheckpointError(f"{index}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise CheckpointError(f"{index}: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> file name")
    return weight_map


def _inside(directory: Path, name: str, index: Path) -> Path:
    """Resolve a file named by the index, refusing anything that escapes the model directory."""
    root = directory.resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root) or path == root:
        raise CheckpointError(f"{index}: file {name!r} points outside the model directory")
    if not path.is_file():
        raise CheckpointError(f"{index}: shard {name!r} does not exist")
    return path


def iter_safetensors(files: list[Path], weight_map: dict[str, str] | None,
                     shard: TPShard | None = None) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield (name, tensor, file) with tensors memory-mapped from disk (no copy until the model takes them).

    With a tensor-parallel `shard`, split tensors are read as this rank's slice only (loader/sharding.py).
    """
    seen: set[str] = set()
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if weight_map is not None and weight_map.get(name) is not None and \
                            (directory_name := Path(weight_map[name]).name) != path.name:
                        raise CheckpointError(f"{path}: tensor {name!r} is listed in the index under {directory_name}")
                    seen.add(name)
                    yield name, _read(f, name, shard), str(path)
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None
    if weight_map is not None:
        missing = sorted(set(weight_map) - seen)
        if missing:
            raise CheckpointError(f"{INDEX_FILE}: {len(missing)} tensor(s) listed but not found in the shards, e.g. {missing[:3]}")


def _read(f, name: str, shard: TPShard | None) -> torch.Tensor:
    """The whole tensor, or only this rank's rows/columns of it (safetensors reads just that slice)."""
    if shard is None or shard.world_size == 1:
        return f.get_tensor(name)
    part = f.get_slice(name)
    bounds = shard_bounds(name, tuple(part.get_shape()), shard)
    if bounds is None:
        return f.get_tensor(name)
    dim, start, length = bounds
    index = tuple(slice(start, start + length) if d == dim else slice(None) for d in range(len(part.get_shape())))
    return part[index]
