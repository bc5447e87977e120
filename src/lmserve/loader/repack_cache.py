"""The kept GGUF blocks in the kernels' layouts, cached on disk and memory-mapped by the next start of the same file.

Repacking a GGUF file's blocks (loader/gguf_packed.py) was about half the model load of every start (issue 32:
start to first token). The first load writes what it built (each swapped layer's codes, scales and mins, which
tensors it kept) to `$LMSERVE_CACHE_DIR/weights/` (~/.cache/lmserve when unset), one file per GGUF file and
repack build; a later load maps that file copy-on-write, as llama.cpp maps its GGUF, and builds the same layers
over it, bit for bit. Mapped pages are the page cache's: clean, shared between processes, never copied.

An entry is keyed by the GGUF file (loader/fingerprint.py: name, size, mtime, first MiB) and the layout key (the
native build, the repack sources, this format). It is checked on read: magic, key, size and a CRC-32 of the data;
a foreign, truncated or corrupt file is ignored (and rewritten), never served. It is written to a temporary file
and renamed into place, so a reader never sees half of one. `LMSERVE_WEIGHT_CACHE=0` turns the cache off; another
value is the directory to use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from lmserve.layers.formats.gguf_embedding import GGUFEmbedding, share_blocks
from lmserve.layers.formats.gguf_linear import FusedGGUFLinear, GGUFLinear, Repacked
from lmserve.layers.kernels.native import build_key
from lmserve.loader.fingerprint import start_cache_path
from lmserve.loader.gguf_file import GGUFFile

log = logging.getLogger(__name__)

MAGIC = b"LMSWGT01"  # the format: a change to the file layout below changes it
_ALIGN = 64  # every array starts at a multiple of this many bytes (cache lines; the kernels' vector loads)
# what decides the bytes of a repacked layer besides the GGUF file: the code that repacks and lays them out
_SOURCES = ("layers/formats/gguf_linear.py", "layers/formats/gguf_embedding.py", "loader/gguf_packed.py", "loader/repack_cache.py")


def cached_keep(net: nn.Module, f: GGUFFile, dtype: torch.dtype, keep: Callable[[nn.Module], set[str]]) -> set[str]:
    """`keep(net)` (gguf_packed.keep_gguf_quantized), or its result read back from the cache: the same layers over
    the same bytes (`dtype`: the embedding's output). Returns the GGUF names kept. A miss builds them and writes the
    entry for the next start."""
    entry = _entry_path(f)
    if entry is None:
        return keep(net)
    key = layout_key()
    kept = restore(net, entry, key, dtype)
    if kept is not None:
        return kept
    kept = keep(net)
    try:
        save(net, kept, entry, key)
    except OSError as e:  # a read-only or full disk: serve anyway, repack again next time
        log.warning("weight cache: cannot write %s (%s)", entry, e)
    return kept


def layout_key() -> str:
    """What a cached layer's bytes depend on besides the GGUF file: the native build (its packed layout) and the
    repack code."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(MAGIC + str(build_key()).encode())
    for rel in _SOURCES:
        h.update((root / rel).read_bytes())
    return h.hexdigest()[:16]


def _entry_path(f: GGUFFile) -> Path | None:
    return start_cache_path(Path(f.path), ".lmw")


# -- writing -------------------------------------------------------------------------------------------------

def save(net: nn.Module, kept: set[str], path: Path, key: str) -> None:
    """Write the GGUF layers of `net` (after keep_gguf_quantized) and the kept names to `path`, atomically."""
    arrays: list[np.ndarray] = []
    parts = {id(p) for m in net.modules() if isinstance(m, FusedGGUFLinear) for p in m.parts}  # saved with it
    modules = [_describe(name, m, net, arrays) for name, m in net.named_modules()
               if isinstance(m, (GGUFEmbedding, FusedGGUFLinear, GGUFLinear)) and id(m) not in parts]
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end = -(-(end + a.nbytes) // _ALIGN) * _ALIGN
    for spec in modules:  # array indices -> [dtype, shape, offset]
        for w in spec["weights"]:
            for field in ("codes", "scales", "mins"):
                if w[field] is not None:
                    a = arrays[w[field]]
                    w[field] = [a.dtype.str, list(a.shape), offsets[w[field]]]
    crc = 0
    for a in arrays:
        crc = zlib.crc32(_padded(a), crc)
    header = json.dumps({"key": key, "kept": sorted(kept), "modules": modules, "data_bytes": end,
                         "crc32": crc}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(MAGIC + struct.pack("<Q", len(header)) + header)
            out.write(b"\0" * (_data_start(len(header)) - out.tell()))
            for a in arrays:
                out.write(_padded(a))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    log.info("weight cache: wrote %s (%.0f MiB)", path, path.stat().st_size / 2**20)


def _describe(name: str, m: nn.Module, net: nn.Module, arrays: list[np.ndarray]) -> dict[str, Any]:
    """One swapped layer as plain data; its tensors are appended to `arrays` (the spec holds their indices)."""
    def weights(layer: nn.Module) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": layer.kind}
        for field in ("codes", "scales", "mins"):
            t = getattr(layer, field)
            out[field] = None if t is None else len(arrays)
            if t is not None:
                arrays.append(t.numpy())
        return out

    if isinstance(m, GGUFEmbedding):
        return {"path": name, "type": "embedding", "weights": [weights(m)]}
    bias = None if m.bias is None else m.bias.shape[0]
    if isinstance(m, FusedGGUFLinear):
        return {"path": name, "type": "fused", "in": m.in_features, "bias": bias,
                "weights": [weights(p) for p in m.parts]}
    embed = getattr(getattr(net, "model", None), "embed_tokens", None)
    if isinstance(embed, GGUFEmbedding) and m.codes.data_ptr() == embed.codes.data_ptr():
        return {"path": name, "type": "tied", "weights": []}  # share_blocks over the table, rebuilt after it
    return {"path": name, "type": "linear", "in": m.in_features, "bias": bias, "weights": [weights(m)]}


def _padded(a: np.ndarray) -> bytes:
    raw = np.ascontiguousarray(a).tobytes()
    return raw + b"\0" * (-len(raw) % _ALIGN)


def _data_start(header_len: int) -> int:
    return -(-(len(MAGIC) + 8 + header_len) // _ALIGN) * _ALIGN


# -- reading -------------------------------------------------------------------------------------------------

def restore(net: nn.Module, path: Path, key: str, dtype: torch.dtype) -> set[str] | None:
    """Swap in the layers cached at `path` and return the kept names; None (net untouched) where the entry is
    missing, foreign, truncated or corrupt."""
    try:
        header, data = _read(path, key)
        swaps = [_rebuild(spec, data, net, dtype) for spec in header["modules"]]
        types = {spec["type"] for spec in header["modules"]}
        if "tied" in types and "embedding" not in types:
            raise ValueError("a tied head without its table")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as e:
        log.warning("weight cache: ignoring %s (%s); repacking the GGUF file again", path, e)
        return None
    for parent, attr, module in swaps:
        if module is not None:
            setattr(parent, attr, module)
    for parent, attr, module in swaps:  # a tied head: over the table just swapped in
        if module is None:
            setattr(parent, attr, share_blocks(net.model.embed_tokens))
    log.info("weight cache: %d GGUF layers mapped from %s", len(swaps), path)
    return set(header["kept"])


def _read(path: Path, key: str) -> tuple[dict[str, Any], memoryview]:
    """The entry's header and its data (a private, copy-on-write map), checked; ValueError says what is wrong."""
    with open(path, "rb") as fh:
        head = fh.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
            raise ValueError("not a weight cache file of this version")
        (n,) = struct.unpack("<Q", head[len(MAGIC):])
        if n > 2**28:
            raise ValueError("corrupt header length")
        header = json.loads(fh.read(n))
        if header.get("key") != key:
            raise ValueError("written by another build or repack version")
        start, size = _data_start(n), os.fstat(fh.fileno()).st_size
        if size != start + header["data_bytes"]:
            raise ValueError(f"{size} bytes, expected {start + header['data_bytes']} (truncated?)")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    data = memoryview(mm)[start:]
    if zlib.crc32(data) != header["crc32"]:  # zlib releases the GIL: the server's imports run beside it
        raise ValueError("checksum mismatch (corrupt)")
    return header, data


def _rebuild(spec: dict[str, Any], data: memoryview, net: nn.Module,
             dtype: torch.dtype) -> tuple[nn.Module, str, nn.Module | None]:
    """(parent, attribute, new layer) for one cached layer; None for a tied head (built once its table is in)."""
    parent_name, _, attr = spec["path"].rpartition(".")
    parent = net.get_submodule(parent_name)
    getattr(parent, attr)  # the model has this layer (AttributeError otherwise)
    ws = [Repacked(w["kind"], *(_array(data, w[f]) for f in ("codes", "scales", "mins"))) for w in spec["weights"]]
    kind = spec["type"]
    if kind == "embedding":
        return parent, attr, GGUFEmbedding(ws[0], dtype)
    if kind == "tied":
        return parent, attr, None
    bias = None if spec["bias"] is None else torch.empty(spec["bias"])  # filled by the loader, as _swap leaves it
    if kind == "fused":
        return parent, attr, FusedGGUFLinear([GGUFLinear(w, spec["in"], None) for w in ws], bias)
    return parent, attr, GGUFLinear(ws[0], spec["in"], bias)


def _array(data: memoryview, desc: list | None) -> np.ndarray | None:
    if desc is None:
        return None
    dtype, shape, offset = np.dtype(desc[0]), tuple(desc[1]), desc[2]
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
