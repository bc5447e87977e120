"""The GGUF header parser's string arrays (the vocabulary and merges): decoded as one run (gguf_file.joined_strings)
they equal the strings decoded one by one (strings_one_by_one, the reference) on the embedded model and on arrays
made here with empty strings, NULs, bytes that are not UTF-8 and a character cut between two strings; a truncated
array or a length past the end of the file is a CheckpointError."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from lmserve.errors import CheckpointError
from lmserve.loader import gguf_file


def _parse_both(path, monkeypatch):
    """(metadata with the joined decode, metadata decoded string by string)."""
    fast = gguf_file._parse(path).metadata
    with monkeypatch.context() as mp:
        mp.setattr(gguf_file, "joined_strings", lambda *args: None)
        reference = gguf_file._parse(path).metadata
    return fast, reference


def _same(a, b) -> bool:
    return list(a) == list(b) and all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else
                                      (type(a[k]), a[k]) == (type(b[k]), b[k]) for k in a)


def _string(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def write_header(path, arrays: dict[str, list[bytes]], tail: bytes = b"") -> None:
    """A GGUF v3 file of string arrays and no tensors (the strings as raw bytes: any byte may be in them)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(arrays) + 1)
    out += _string(b"general.architecture") + struct.pack("<I", 8) + _string(b"llama")
    for key, items in arrays.items():
        out += _string(key.encode()) + struct.pack("<IIQ", 9, 8, len(items)) + b"".join(map(_string, items))
    path.write_bytes(out + tail)


def test_the_embedded_vocabulary_decodes_as_one_run_and_string_by_string_alike(smol_path, monkeypatch):
    fast, reference = _parse_both(smol_path, monkeypatch)
    assert _same(fast, reference)
    assert len(fast["tokenizer.ggml.tokens"]) == 49152 and len(fast["tokenizer.ggml.merges"]) == 48900


CASES = {
    "plain": [b"hello", b"\xc4\xa0the", "日本語".encode(), "🎉".encode(), b"", b"", b"a b", b"x"],
    "empty strings only": [b"", b"", b""],
    "one string": ["Ġ".encode()],
    "a NUL inside": [b"a", b"b\x00c", b"d"],
    "not UTF-8": [b"ok", b"\xff\xfe", b"fine"],
    "a character cut between two strings": [b"\xe6\x97", b"\xa5", b"end"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_made_string_arrays_decode_as_each_string_alone(tmp_path, monkeypatch, case):
    items = CASES[case]
    write_header(tmp_path / "h.gguf", {"tokenizer.ggml.tokens": items, "tokenizer.ggml.merges": items[::-1]})
    fast, reference = _parse_both(tmp_path / "h.gguf", monkeypatch)
    assert _same(fast, reference)
    assert fast["tokenizer.ggml.tokens"] == [raw.decode("utf-8", "replace") for raw in items]


def test_valid_arrays_take_the_joined_decode(tmp_path):
    """The fast path is the one that runs on a clean vocabulary (the fallback cases above leave it)."""
    items = CASES["plain"]
    write_header(tmp_path / "h.gguf", {"tokenizer.ggml.tokens": items})
    raw = (tmp_path / "h.gguf").read_bytes()
    first = raw.index(_string(items[0]))
    starts = [first + sum(8 + len(s) for s in items[:i]) for i in range(len(items))]
    buf = memoryview(raw)
    assert gguf_file.joined_strings(buf, starts, len(raw)) == gguf_file.strings_one_by_one(buf, starts, len(raw))
    assert gguf_file.joined_strings(buf, starts, len(raw)) is not None
    assert gguf_file.joined_strings(buf, [], first) == []


def test_a_truncated_or_overlong_array_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "h.gguf"
    write_header(path, {"tokenizer.ggml.tokens": [b"abc", b"defgh", b"ij"]})
    whole = path.read_bytes()
    for cut in (3, 9, 14):  # inside the last string, inside its length field, inside the one before
        path.write_bytes(whole[:-cut])
        with pytest.raises(CheckpointError, match="truncated or corrupt"):
            gguf_file._parse(path)
    path.write_bytes(whole[:-10] + struct.pack("<Q", 2**40) + b"ij")  # the last length points past the end
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        gguf_file._parse(path)
