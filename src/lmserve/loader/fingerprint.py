"""What identifies a checkpoint's weights cheaply: the response cache and the KV tier key their entries by it, and
the start cache (what a start derives from a model file: loader/repack_cache.py, loader/start_cache.py) names its
files by it."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

START_CACHE_ENV = "LMSERVE_WEIGHT_CACHE"  # "0": no start cache (never read or written); else its directory

_HEAD_BYTES = 2**20  # of each weight file, hashed into the fingerprint
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")


def weights_fingerprint(path: Path) -> str:
    """A short digest of a checkpoint file or directory: each file's name, size and mtime, and the first MiB of
    each weight file. Not a full hash (a start reads no more than a few MiB); any re-export changes it."""
    if path.is_file():  # one file's digest is kept while its stat stays the same: a start asks for it 2-3 times
        st = path.stat()
        return _file_fingerprint(str(path.resolve()), path.name, st.st_size, st.st_mtime_ns, st.st_ino)
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        _add_file(h, f, f.suffix in _WEIGHT_SUFFIXES)
    return h.hexdigest()[:16]


def served_fingerprint(loaded: Any) -> str:
    """A loaded model's weights: its checkpoint's fingerprint, and its projector file's where a text GGUF is served
    with one (--mmproj): the same text model with another projector encodes images differently, so KV blocks and
    cached responses of one must never be read for the other. A vision model's tower dtype (--mm-encoder-dtype) too:
    a bf16 tower's embeddings are not a float32 one's, nor the KV computed from them."""
    fp = weights_fingerprint(Path(loaded.path))
    mmproj = getattr(loaded, "mmproj", None)
    fp = fp if mmproj is None else f"{fp}+{weights_fingerprint(Path(mmproj.path))}"
    tower = getattr(loaded, "encoder_dtype", None)
    return fp if tower is None else f"{fp}:tower={str(tower).removeprefix('torch.')}"


@functools.lru_cache(maxsize=16)
def _file_fingerprint(path: str, name: str, size: int, mtime_ns: int, inode: int) -> str:
    h = hashlib.sha256()
    _add_file(h, Path(path), True, name)
    return h.hexdigest()[:16]


def _add_file(h: Any, f: Path, head: bool, name: str | None = None) -> None:
    """`f`'s name (`name`: the one it was given by, where that is a link), size and mtime, and its first MiB."""
    st = f.stat()
    h.update(f"{name or f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    if head:
        with open(f, "rb") as fh:
            h.update(fh.read(_HEAD_BYTES))


def start_cache_path(path: Path, suffix: str) -> Path | None:
    """Where the start cache keeps what is derived from model file `path` (`suffix`: which derivation), or None when
    $LMSERVE_WEIGHT_CACHE is "0". Default directory: $LMSERVE_CACHE_DIR/weights (~/.cache/lmserve/weights)."""
    given = os.environ.get(START_CACHE_ENV)
    if given == "0":
        return None
    root = Path(given or Path(os.environ.get("LMSERVE_CACHE_DIR", Path.home() / ".cache" / "lmserve")) / "weights")
    return root / f"{path.stem}-{weights_fingerprint(path)}{suffix}"
