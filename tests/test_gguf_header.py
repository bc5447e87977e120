"""The GGUF header parser's string arrays (the vocabulary and merges): decoded as one run (gguf_file.joined_strings)
they equal the strings decoded one by one (strings_one_by_one, the reference) on the embedded model and on arrays
made here with empty strings, NULs, bytes that are not UTF-8 and a character cut between two strings; a truncated
array or a length past the end of the file is a CheckpointError. The header kept in the start cache
(loader/start_cache.py) is the parsed header, on the embedded model and a tiny file; a damaged, foreign or stale
entry is parsed again and rewritten, never served; LMSERVE_WEIGHT_CACHE=0 writes nothing."""

from __future__ import annotations

import os
import struct

import gguf
import numpy as np
import pytest

from lmserve.errors import CheckpointError
from lmserve.loader import gguf_file, start_cache


def _parse_both(path, monkeypatch):
    """(metadata with the joined decode, metadata decoded string by string), both parsed (no start cache)."""
    monkeypatch.setenv("LMSERVE_WEIGHT_CACHE", "0")
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


def write_tiny(path) -> None:
    """A small GGUF file with every kind of metadata the parser returns and two tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128), w.add_embedding_length(8), w.add_block_count(1), w.add_feed_forward_length(16)
    w.add_token_list(["<s>", "Ġthe", "日本", ""]), w.add_token_types([3, 1, 1, 1])
    w.add_token_scores([0.0, -1.5, -2.0, -3.0]), w.add_token_merges(["Ġ t", "h e"]), w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float16))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def _described(f: gguf_file.GGUFFile) -> tuple:
    meta = [(k, type(v), v.dtype.str if isinstance(v, np.ndarray) else None,
             v.tolist() if isinstance(v, np.ndarray) else v) for k, v in f.metadata.items()]
    return meta, [(t.name, t.ggml_type, t.shape, t.data.tobytes()) for t in f.tensors]


def _no_parse(monkeypatch) -> None:
    def refuse(*_args):
        raise AssertionError("parsed although the start cache holds this header")

    monkeypatch.setattr(gguf_file, "parse_header", refuse)


@pytest.mark.parametrize("which", ["tiny", "embedded"])
def test_a_cached_header_is_the_parsed_header(tmp_path, monkeypatch, smol_path, which):
    path = tmp_path / "tiny.gguf" if which == "tiny" else smol_path
    if which == "tiny":
        write_tiny(path)
    monkeypatch.setenv("LMSERVE_WEIGHT_CACHE", "0")
    parsed = _described(gguf_file._parse(path))
    monkeypatch.setenv("LMSERVE_WEIGHT_CACHE", str(tmp_path / "cache"))
    assert _described(gguf_file._parse(path)) == parsed  # parsed, and written
    (entry,) = (tmp_path / "cache").glob("*.header")
    with monkeypatch.context() as mp:
        _no_parse(mp)
        assert _described(gguf_file._parse(path)) == parsed  # read back
    assert entry.read_bytes()[:len(start_cache.MAGIC)] == start_cache.MAGIC


def test_a_bad_header_entry_is_parsed_again_and_rewritten(tmp_path, monkeypatch):
    """Truncated, foreign magic, a flipped byte, another key, another file's entry, the right key over other data."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LMSERVE_WEIGHT_CACHE", str(cache))
    path, other = tmp_path / "tiny.gguf", tmp_path / "other.gguf"
    write_tiny(path)
    write_header(other, {"tokenizer.ggml.tokens": [b"x", b"y"]})
    parsed = _described(gguf_file._parse(path))
    gguf_file._parse(other)
    entry, other_entry = cache / next(cache.glob("tiny-*.header")).name, next(cache.glob("other-*.header"))
    good = entry.read_bytes()
    key = good[8:24]
    start_cache.write(tmp_path / "wrong", key, ["not", "a", "header"])
    parses = []
    real = gguf_file.parse_header
    monkeypatch.setattr(gguf_file, "parse_header", lambda *a: parses.append(1) or real(*a))
    bad = [good[:-7], b"NOTSTART" + good[8:], good[:-1] + bytes([good[-1] ^ 0xFF]), good[:8] + b"0" * 16 + good[24:],
           other_entry.read_bytes(), (tmp_path / "wrong").read_bytes()]
    for i, raw in enumerate(bad):
        entry.write_bytes(raw)
        assert _described(gguf_file._parse(path)) == parsed, i
        assert entry.read_bytes() == good and len(parses) == i + 1  # parsed again and rewritten
    assert _described(gguf_file._parse(path)) == parsed and len(parses) == len(bad)  # the rewritten entry serves


def test_off_writes_no_header_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSERVE_WEIGHT_CACHE", "0")
    monkeypatch.setenv("LMSERVE_CACHE_DIR", str(tmp_path))
    write_tiny(tmp_path / "tiny.gguf")
    gguf_file._parse(tmp_path / "tiny.gguf")
    assert not list(tmp_path.rglob("*.header"))


def test_a_multi_model_start_parses_each_file_once(tmp_path, monkeypatch):
    """read_gguf keeps its last RECENT_FILES parses: checking N files and then loading each (a multi-model start)
    parses each once; a file changed since is parsed again, and the oldest parse is dropped past the bound."""
    monkeypatch.setattr(gguf_file, "_recent", type(gguf_file._recent)())
    parses = []
    real = gguf_file._parse
    monkeypatch.setattr(gguf_file, "_parse", lambda p: parses.append(p.name) or real(p))
    paths = [tmp_path / f"m{i}.gguf" for i in range(3)]
    for p in paths:
        write_tiny(p)
    checked = [gguf_file.read_gguf(p) for p in paths]
    loaded = [gguf_file.read_gguf(p) for p in paths]
    assert parses == ["m0.gguf", "m1.gguf", "m2.gguf"] and all(a is b for a, b in zip(checked, loaded))
    write_tiny(paths[0])  # rewritten in place: the same inode and size, so a later mtime (set: clocks are coarse)
    st = paths[0].stat()
    os.utime(paths[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert gguf_file.read_gguf(paths[0]) is not checked[0] and parses[-1] == "m0.gguf"
    more = [tmp_path / f"n{i}.gguf" for i in range(gguf_file.RECENT_FILES - 1)]
    for i, p in enumerate(more):
        write_tiny(p)
        gguf_file.read_gguf(p)
        if i == 2:
            gguf_file.read_gguf(paths[2])  # used again: the least recently used goes first, not the first parsed
    n = len(parses)
    gguf_file.read_gguf(paths[2])  # kept: read among the newer ones
    gguf_file.read_gguf(paths[1])  # pushed out by the RECENT_FILES newer ones
    assert parses[n:] == ["m1.gguf"] and len(gguf_file._recent) == gguf_file.RECENT_FILES
