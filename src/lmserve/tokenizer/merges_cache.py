"""BPE merges derived from a GGUF vocabulary, kept in the start cache beside the repacked weights.

A SentencePiece-style GGUF file (Gemma's, Llama 2's) stores pieces and scores but no merges; gguf_vocab derives
them: for Gemma 3's 262K pieces that is 1.8 CPU s of every start (issue 32). The first start writes the derived
list to the start cache (loader/fingerprint.start_cache_path: named by the file's fingerprint, in
$LMSERVE_WEIGHT_CACHE's directory; "0" turns it off) and later starts read it back (~0.3 s). An entry is checked
as a weight-cache entry is (magic, key, size, CRC-32 of the data); the key covers the code that derives the merges
and Python's marshal format. A foreign, stale or damaged entry is derived again and rewritten, never used.
"""

from __future__ import annotations

import hashlib
import logging
import marshal
import struct
import sys
import zlib
from pathlib import Path
from typing import Callable

from lmserve.loader.fingerprint import start_cache_path
from lmserve.utils import write_atomically

log = logging.getLogger(__name__)

Merges = list[tuple[str, str]]
MAGIC = b"LMSMRG01"
_HEAD = struct.Struct("<16sQI")  # key, data bytes, CRC-32 of the data
# what decides the merges besides the GGUF file: the code that derives them (and how they are stored)
_SOURCES = ("tokenizer/gguf_vocab.py", "tokenizer/merges_cache.py")


def cached_merges(source: str, derive: Callable[[], Merges]) -> Merges:
    """`derive()`, or what it returned for this same file at an earlier start (`source`: the GGUF file's path)."""
    path = start_cache_path(Path(source), ".merges") if Path(source).is_file() else None
    if path is None:
        return derive()
    key = merges_key()
    try:
        return read(path, key)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, EOFError, TypeError) as e:  # marshal's errors on bad bytes, our checks' ValueError
        log.info("merges cache: ignoring %s (%s); deriving the merges again", path, e)
    merges = derive()
    try:
        write(path, key, merges)
    except OSError as e:  # a read-only or full disk: serve anyway, derive again next time
        log.warning("merges cache: cannot write %s (%s)", path, e)
    return merges


def merges_key() -> bytes:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(MAGIC + f"{sys.version_info[:2]} {marshal.version}".encode())
    for rel in _SOURCES:
        h.update((root / rel).read_bytes())
    return h.hexdigest()[:16].encode()


def write(path: Path, key: bytes, merges: Merges) -> None:
    """The entry, whole or not at all (a reader never sees half of one)."""
    data = marshal.dumps(merges)
    write_atomically(path, MAGIC + _HEAD.pack(key, len(data), zlib.crc32(data)) + data)


def read(path: Path, key: bytes) -> Merges:
    """The entry's merges; ValueError says why an entry cannot be used."""
    raw = path.read_bytes()
    start = len(MAGIC) + _HEAD.size
    if len(raw) < start or raw[:len(MAGIC)] != MAGIC:
        raise ValueError("not a merges cache file of this version")
    found, size, crc = _HEAD.unpack_from(raw, len(MAGIC))
    if found != key:
        raise ValueError("written by other tokenizer code or another Python")
    data = memoryview(raw)[start:]
    if len(data) != size or zlib.crc32(data) != crc:
        raise ValueError("truncated or corrupt")
    merges = marshal.loads(data)
    if not isinstance(merges, list):
        raise ValueError("not a list of merges")
    return merges
