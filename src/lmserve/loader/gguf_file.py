"""A fast, bounds-checked GGUF (v2/v3) parser over a memory map.

The `gguf` package's reader builds a numpy memmap view per metadata element, which takes seconds
on a 100k-entry vocabulary; this reads the header once with `struct` and numpy and maps tensor data
without copying. Every length and offset is checked against the file size, so a truncated or
corrupt file raises CheckpointError instead of reading garbage. The parsed header is kept in the start cache
(loader/start_cache.py), so a later start of the same file reads it back instead of decoding its strings again.
"""

from __future__ import annotations

import math
import mmap
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmserve.errors import CheckpointError
from lmserve.loader.start_cache import cached

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
       10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4
# Arrays of arrays may nest this deep (llama.cpp reads none; the `gguf` package writes them): the reader recurses
# once per level, and a file nesting them 200,000 deep was a RecursionError.
MAX_ARRAY_DEPTH = 8
MAX_ALIGNMENT = 1 << 20  # general.alignment: llama.cpp writes 32; a larger power of two is legal, up to this
# ggml's tensor types: id -> (name, weights per block, bytes per block), as the `gguf` package's GGML_QUANT_SIZES has
# them (tests/test_gguf_linear.py compares the two). Held here so that a start imports no `gguf` (0.1-0.15 CPU s:
# its enums and its YAML metadata reader); only dequantizing a quantized tensor to float needs it.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
              15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
              19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
              23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
              28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
              35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18)}
# general.file_type -> its name (the gguf package's LlamaFileType), for /api/show and the model-info metric
FILE_TYPES = {0: "ALL_F32", 1: "MOSTLY_F16", 2: "MOSTLY_Q4_0", 3: "MOSTLY_Q4_1", 7: "MOSTLY_Q8_0", 8: "MOSTLY_Q5_0",
              9: "MOSTLY_Q5_1", 10: "MOSTLY_Q2_K", 11: "MOSTLY_Q3_K_S", 12: "MOSTLY_Q3_K_M", 13: "MOSTLY_Q3_K_L",
              14: "MOSTLY_Q4_K_S", 15: "MOSTLY_Q4_K_M", 16: "MOSTLY_Q5_K_S", 17: "MOSTLY_Q5_K_M", 18: "MOSTLY_Q6_K",
              19: "MOSTLY_IQ2_XXS", 20: "MOSTLY_IQ2_XS", 21: "MOSTLY_Q2_K_S", 22: "MOSTLY_IQ3_XS",
              23: "MOSTLY_IQ3_XXS", 24: "MOSTLY_IQ1_S", 25: "MOSTLY_IQ4_NL", 26: "MOSTLY_IQ3_S", 27: "MOSTLY_IQ3_M",
              28: "MOSTLY_IQ2_S", 29: "MOSTLY_IQ2_M", 30: "MOSTLY_IQ4_XS", 31: "MOSTLY_IQ1_M", 32: "MOSTLY_BF16",
              36: "MOSTLY_TQ1_0", 37: "MOSTLY_TQ2_0", 38: "MOSTLY_MXFP4_MOE", 39: "MOSTLY_NVFP4", 40: "MOSTLY_Q1_0",
              1024: "GUESSED"}


@dataclass
class GGUFTensor:
    """One tensor's header entry and its raw bytes (a view into the memory map)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # HF order: slowest-varying dimension first, e.g. (rows, cols)
    data: np.ndarray  # uint8 view of the tensor's bytes


@dataclass
class GGUFFile:
    """Parsed metadata (key -> Python value, arrays as lists or numpy arrays) and tensors."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    mm: mmap.mmap | None = field(default=None, repr=False)  # the map the tensors view

    def release_pages(self) -> None:
        """Drop the mapped file pages from this process's resident memory once the weights are copied out.

        The map stays valid: a later read faults its pages back in from the page cache. Dequantized or
        repacked weights never view the map, so serving reads none of it (the embedded Q4_1 file: ~94 MiB
        of RSS that a loaded model kept for nothing).
        """
        if self.mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mm.madvise(mmap.MADV_DONTNEED)


def type_name(t: GGUFTensor) -> str:
    """The GGML type's name of a tensor (Q4_1, Q8_0, F32, ...)."""
    return GGML_TYPES[t.ggml_type][0]


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF header (read past end at byte {self.pos})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        return bytes(raw).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` length-prefixed strings: the vocabulary and merges (100k entries). The lengths are walked in a
        tight loop, then the run is decoded in one call (`joined_strings`): 0.08 -> 0.04 CPU s for SmolLM2's header.
        Where that cannot give each string's own decoding, each is decoded alone (`strings_one_by_one`)."""
        starts, length_at = [], _LENGTH.unpack_from
        pos, mark = self.pos, starts.append
        try:
            for _ in range(count):  # each string's length field; the loop stays minimal: it runs 100k times
                mark(pos)
                pos += 8 + length_at(self.buf, pos)[0]
        except (struct.error, OverflowError):  # a length field past the end of the file (or past any offset)
            pos = len(self.buf) + 1
        if pos > len(self.buf):  # a string or a length field reaches past the end
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF header (read past end at byte {pos})")
        self.pos = pos
        out = joined_strings(self.buf, starts, pos)
        return out if out is not None else strings_one_by_one(self.buf, starts, pos)

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        """One metadata value of type `vtype` (of the key `key`, for errors); `depth`: the arrays it is inside."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise CheckpointError(f"{self.path}: GGUF metadata {key[:80]!r}: arrays nested more than "
                                      f"{MAX_ARRAY_DEPTH} deep")
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _NP:
                dtype = np.dtype(_NP[item_type])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).copy()
            if count > len(self.buf):  # every element takes at least one byte
                raise CheckpointError(f"{self.path}: GGUF metadata {key[:80]!r}: corrupt array length {count}")
            if item_type == _STRING:
                return self.strings(count)
            return [self.value(item_type, key, depth + 1) for _ in range(count)]
        raise CheckpointError(f"{self.path}: GGUF metadata {key[:80]!r}: unknown value type {vtype}")


_LENGTH = struct.Struct("<Q")  # a GGUF string's length field


def strings_one_by_one(buf: memoryview, starts: list[int], end: int) -> list[str]:
    """The strings whose length fields are at `starts` (the last one ends at `end`), each decoded alone: bytes that
    are not UTF-8 become U+FFFD. The reference for `joined_strings`."""
    ends = starts[1:] + [end]
    return [str(buf[at + 8:stop], "utf-8", "replace") for at, stop in zip(starts, ends)]


def joined_strings(buf: memoryview, starts: list[int], end: int) -> list[str] | None:
    """`strings_one_by_one` in a few calls, or None where this way cannot give the same strings.

    Each length field becomes one NUL and the run is decoded once and split at the NULs. That is exact when no
    string holds a NUL of its own and the run is valid UTF-8: a NUL is then a character boundary, so each piece
    is valid alone and decodes as it would alone. Otherwise (a NUL, or bytes that decode to U+FFFD) None.
    """
    if not starts:
        return []
    first = starts[0]
    run = np.frombuffer(buf, np.uint8, end - first, first).copy()
    fields = np.asarray(starts, dtype=np.int64) - first
    run[fields] = 0  # each length field's first byte: the NUL before its string
    keep = np.ones(run.size, dtype=bool)
    for byte in range(1, 8):
        keep[fields + byte] = False
    keep[0] = False  # no NUL before the first string
    joined = run[keep].tobytes()
    if joined.count(0) != len(starts) - 1:
        return None
    try:
        return joined.decode("utf-8").split("\x00")
    except UnicodeDecodeError:
        return None


_recent: OrderedDict[tuple, GGUFFile] = OrderedDict()  # (path, size, mtime, inode) -> its parse, last used last
_recent_lock = threading.Lock()
RECENT_FILES = 8  # parses kept: a multi-model start checks every file, then loads each (all of them within 8)


def read_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file's header and map its tensors.

    The last RECENT_FILES files parsed are kept while their size, mtime and inode stay the same: a start reads each
    file for the checks before loading (the config) and again to load it, and parsing SmolLM2's 100k-string header
    took 0.17 s of every start. Keeping only the last one made a multi-model start (every model checked, then each
    loaded) read every file but the last twice (31-65 ms a model from the start cache). Callers only read a GGUFFile
    (its tensors view a read-only map).
    """
    try:
        st = Path(path).stat()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e})") from None
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    with _recent_lock:
        if key in _recent:
            _recent.move_to_end(key)
            return _recent[key]
    parsed = _parse(path)
    with _recent_lock:
        _recent[key] = parsed
        while len(_recent) > RECENT_FILES:
            _recent.popitem(last=False)
    return parsed


def _parse(path: Path) -> GGUFFile:
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot open ({e})") from None
    metadata, infos, start = _header(memoryview(mm), path)
    arr = np.frombuffer(mm, dtype=np.uint8)
    tensors = [_map_tensor(arr, start, info, path) for info in infos]
    return GGUFFile(path, metadata, tensors, mm)


Header = tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]  # metadata, tensor entries, data start


def _header(buf: memoryview, path: Path) -> Header:
    """The file's header: read back from the start cache (loader/start_cache.py: keyed by the file's fingerprint and
    this module's code), else parsed and kept there for the next start. Each tensor is still mapped and checked
    against the file itself."""
    kept = cached(Path(path), ".header", ("loader/gguf_file.py",), lambda: _plain(parse_header(buf, path)),
                  _is_plain)
    metadata, infos, start = kept
    return {key: _value(v) for key, v in metadata.items()}, infos, start


def parse_header(buf: memoryview, path: Path) -> Header:
    """The metadata, the tensors' header entries and where their data starts, parsed from the file's bytes."""
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != b"GGUF":  # checked before any read, so a short text file is named for what it is
        raise CheckpointError(f"{path}: not a GGUF file (bad magic)")
    cur.take(4)
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise CheckpointError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"), key)
    infos = [_tensor_info(cur) for _ in range(n_tensors)]
    alignment = _alignment(metadata.get("general.alignment", 32), path)
    return metadata, infos, -(-cur.pos // alignment) * alignment


def _alignment(value: Any, path: Path) -> int:
    """general.alignment, checked: an integer power of two (llama.cpp asserts the same); tensor data starts at a
    multiple of it, so 0 divided by zero and a string had no meaning."""
    if type(value) is not int or not 0 < value <= MAX_ALIGNMENT or value & (value - 1):
        shown = repr(value)[:40] if isinstance(value, (int, float, str)) else f"a {type(value).__name__}"
        raise CheckpointError(f"{path}: GGUF metadata 'general.alignment' must be an integer power of two up to "
                              f"{MAX_ALIGNMENT}, got {shown}")
    return value


def _plain(header: Header) -> Header:
    """The header as data marshal writes: each numeric array as a (dtype, bytes) tuple (the parser makes no tuples)."""
    metadata, infos, start = header
    return {key: _plain_value(v) for key, v in metadata.items()}, infos, start


def _plain_value(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.dtype.str, v.tobytes()
    if isinstance(v, list) and v and isinstance(v[0], (list, np.ndarray)):  # an array of arrays (its items: one type)
        return [_plain_value(item) for item in v]
    return v


def _value(v: Any) -> Any:
    """`_plain_value` undone."""
    if isinstance(v, tuple):
        return np.frombuffer(v[1], dtype=np.dtype(v[0])).copy()
    if isinstance(v, list) and v and isinstance(v[0], (list, tuple)):
        return [_value(item) for item in v]
    return v


def _is_plain(kept: Any) -> bool:
    return isinstance(kept, tuple) and len(kept) == 3 and isinstance(kept[0], dict) and isinstance(kept[1], list) \
        and isinstance(kept[2], int)


def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.scalar("<I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise CheckpointError(f"{cur.path}: tensor {name!r} has {n_dims} dimensions")
    dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
    return name, dims, cur.scalar("<I"), cur.scalar("<Q")


def _map_tensor(arr: np.ndarray, start: int, info: tuple, path: Path) -> GGUFTensor:
    name, dims, ggml_type, offset = info
    if ggml_type not in GGML_TYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown type {ggml_type}")
    _, block, type_size = GGML_TYPES[ggml_type]
    if dims[0] % block:
        raise CheckpointError(f"{path}: tensor {name!r} row length {dims[0]} is not a multiple of {block}")
    nbytes = math.prod(dims) // block * type_size  # Python ints: 2**64-sized dimensions cannot wrap around
    begin = start + offset
    if begin + nbytes > arr.shape[0]:
        raise CheckpointError(f"{path}: tensor {name!r} extends past the end of the file (truncated?)")
    return GGUFTensor(name, ggml_type, tuple(reversed(dims)), arr[begin:begin + nbytes])
