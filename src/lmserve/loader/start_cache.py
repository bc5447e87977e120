"""Plain data a start derives from a model file, kept in the start cache beside the repacked weights.

Two derivations are worth keeping (issue 32: start to first token): a GGUF file's parsed header (loader/gguf_file.py:
SmolLM2's 100k vocabulary and merge strings, 45 CPU ms of every start, Gemma 3's 260k, 120 ms) and the BPE merges a
SentencePiece-style vocabulary implies (tokenizer/gguf_vocab.py: 1.8 CPU s for Gemma 3's). The first start writes
what it derived (Python's marshal format) to the file loader/fingerprint.start_cache_path names for the model file
and the derivation; later starts read it back. An entry is checked as a weight-cache entry is: magic, key, size and a
CRC-32 of the data, the key covering the file, the code that derives it, this module and marshal's format; the caller's
`valid` checks the shape of what comes back. A foreign, stale or damaged entry is derived again and rewritten,
never used. LMSERVE_WEIGHT_CACHE=0: nothing is read or written.
"""

from __future__ import annotations

import hashlib
import logging
import marshal
import struct
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from lmserve.files import write_atomically
from lmserve.loader.fingerprint import start_cache_path, weights_fingerprint

log = logging.getLogger(__name__)

T = TypeVar("T")
MAGIC = b"LMSSTC01"  # the entry layout below; a change to it changes this
_HEAD = struct.Struct("<16sQI")  # key, data bytes, CRC-32 of the data


def cached(source: Path, suffix: str, code: tuple[str, ...], derive: Callable[[], T],
           valid: Callable[[Any], bool]) -> T:
    """`derive()`, or what it returned for this same model file at an earlier start.

    `suffix` names the derivation (the entry's file suffix), `code` the modules (paths under lmserve/) whose source
    decides its result, `valid` whether a value read back has the shape `derive` returns. The value must be plain
    data that marshal writes (str, numbers, bytes, lists, tuples, dicts).
    """
    path = start_cache_path(source, suffix) if source.is_file() else None
    if path is None:
        return derive()
    key = entry_key(suffix, code, weights_fingerprint(source))
    try:
        value = read(path, key)
        if valid(value):
            return value
        log.info("start cache: ignoring %s (not what this code derives); deriving it again", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, EOFError, TypeError) as e:  # marshal's errors on bad bytes, our checks' ValueError
        log.info("start cache: ignoring %s (%s); deriving it again", path, e)
    value = derive()
    try:
        write(path, key, value)
    except OSError as e:  # a read-only or full disk: serve anyway, derive again next time
        log.warning("start cache: cannot write %s (%s)", path, e)
    return value


def entry_key(suffix: str, code: tuple[str, ...], fingerprint: str) -> bytes:
    """What an entry's value depends on: the model file (its fingerprint: an entry copied to another file's name is
    foreign there), the deriving code, this module and Python's marshal format."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(MAGIC + f"{fingerprint} {suffix} {sys.version_info[:2]} {marshal.version}".encode())
    for rel in (*code, "loader/start_cache.py"):
        h.update((root / rel).read_bytes())
    return h.hexdigest()[:16].encode()


def write(path: Path, key: bytes, value: Any) -> None:
    """The entry, whole or not at all (a reader never sees half of one)."""
    data = marshal.dumps(value)
    write_atomically(path, MAGIC + _HEAD.pack(key, len(data), zlib.crc32(data)) + data)


def read(path: Path, key: bytes) -> Any:
    """The entry's value; ValueError says why an entry cannot be used."""
    raw = path.read_bytes()
    start = len(MAGIC) + _HEAD.size
    if len(raw) < start or raw[:len(MAGIC)] != MAGIC:
        raise ValueError("not a start cache file of this version")
    found, size, crc = _HEAD.unpack_from(raw, len(MAGIC))
    if found != key:
        raise ValueError("written by other code or another Python")
    data = memoryview(raw)[start:]
    if len(data) != size or zlib.crc32(data) != crc:
        raise ValueError("truncated or corrupt")
    return marshal.loads(data)
