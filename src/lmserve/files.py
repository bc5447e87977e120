"""Files lmserve reads and writes: private files and directories (0600 in 0700: what the server stores is its
users' data), whole-or-nothing writes, SQLite stores, and JSON files whose nesting is bounded before they are parsed."""

from __future__ import annotations

import os
import secrets
import sqlite3
import stat
from pathlib import Path
from typing import Any, BinaryIO


def write_atomically(path: Path, data: bytes) -> None:
    """Whole or not at all: a temporary file beside `path` (named for this process, so two writers never share
    one), then an atomic rename over it; a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def user_data_dir() -> Path:
    """lmserve's user data (playground shares, batch jobs): $XDG_DATA_HOME/lmserve, ~/.local/share/lmserve when unset."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "lmserve"


def user_cache_dir() -> Path:
    """lmserve's caches (the response cache's file): $XDG_CACHE_HOME/lmserve, ~/.cache/lmserve when unset."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lmserve"


# -- private files: what the server stores is 0600 in 0700 directories (issue 47) ----------------------------------
# The helpers take permissions from the calls themselves (mode arguments, O_EXCL | O_NOFOLLOW, fchmod), never from
# os.umask: the umask is per process, and another thread creating a file at the same moment would get ours.

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def private_dir(path: Path, own: bool = False) -> Path:
    """A directory for private files: missing levels are made 0700. An existing one that every user may write is
    refused (PermissionError: anyone could plant or swap files in it). `own`: the directory is lmserve's alone
    (a store's own, the KV tier's), so another user's is refused too and one of ours is tightened to 0700."""
    path = Path(path)
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for level in reversed(missing):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:  # made meanwhile by another process: checked below like any existing one
            pass
    path = missing[0] if missing else path
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    if st.st_mode & stat.S_IWOTH:
        raise PermissionError(f"{path} is writable by every user (mode {st.st_mode & 0o7777:04o}); give a "
                              f"directory only this user can write")
    if own and hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to another user (uid {st.st_uid}); give a directory of this "
                              f"user's own")
    if own and st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def private_file(path: Path) -> None:
    """Make `path` an existing file of mode 0600 (created so, or an older file of ours tightened); a symlink at the
    path is refused (OSError), not followed. SQLite gives its -journal, -wal and -shm files the database's mode."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def create_private(path: Path) -> int:
    """A new file's descriptor, mode 0600, opened for writing: O_EXCL | O_NOFOLLOW, so neither a file nor a symlink
    planted at `path` is ever written through (FileExistsError / OSError)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)


def temporary_name(path: Path) -> Path:
    """A temporary name beside `path` that nobody can predict (a planted file or symlink cannot be waiting there)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")


def write_private(path: Path, data: bytes) -> None:
    """write_atomically for private data: a 0600 file through an unpredictable O_EXCL | O_NOFOLLOW temporary name,
    renamed over `path` (whose directory must exist: make it with private_dir)."""
    tmp = temporary_name(path)
    fd = create_private(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_nofollow(path: Path) -> BinaryIO:
    """A file opened for reading; a symlink at `path` is refused (OSError), not read through."""
    return os.fdopen(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb")


def append_private(path: Path) -> BinaryIO:
    """A binary file opened for appending, created 0600 when new; a symlink at `path` is refused, not followed."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o600), "ab")


def read_secret(path: Path, nbytes: int = 32) -> bytes:
    """The `nbytes` random bytes in `path`, made (0600, whole or not at all) when it does not exist. A secret that
    is not a plain file of this user's, or that others may read, is refused (PermissionError / ValueError)."""
    try:
        f = open_nofollow(path)
    except FileNotFoundError:
        tmp = temporary_name(path)
        with os.fdopen(create_private(tmp), "wb") as f:
            f.write(secrets.token_bytes(nbytes))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if another process made one meanwhile: then theirs is the secret
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        return read_secret(path, nbytes)
    with f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
            raise PermissionError(f"{path} is not a file of this user's")
        if st.st_mode & 0o077:
            raise PermissionError(f"{path} may be read by other users (mode {st.st_mode & 0o777:04o}); delete it "
                                  f"and a new one is made")
        data = f.read(nbytes + 1)
    if len(data) != nbytes:
        raise ValueError(f"{path} does not hold a {nbytes}-byte secret; delete it and a new one is made")
    return data


def lmserve_dirs() -> tuple[Path, ...]:
    """The directories lmserve names by default: its own (private_dir(own=True)) when a store lives there."""
    return user_data_dir(), user_data_dir() / "batches", user_cache_dir()


def open_sqlite(path: Path, schema: tuple[str, ...], timeout: float = 2.0) -> sqlite3.Connection:
    """A SQLite file's one connection, shared by worker threads (callers serialise their use with a lock), with
    `schema`'s statements run (CREATE ... IF NOT EXISTS). The file is 0600 in a private_dir (lmserve's own when it
    is one of lmserve_dirs); its journals take its mode. OSError / sqlite3.Error."""
    private_dir(path.parent, own=path.parent in lmserve_dirs())
    private_file(path)
    db = sqlite3.connect(str(path), check_same_thread=False, timeout=timeout)
    for statement in schema:
        db.execute(statement)
    db.commit()
    return db


# How deep arrays and objects may nest in a JSON file the server reads (a checkpoint's config.json, tokenizer.json, an
# adapter's config): real ones nest under 10 levels. json.loads recurses once per level, so a file nested 200,000 deep
# is a RecursionError; Hugging Face `tokenizers` stops at 128.
MAX_JSON_FILE_DEPTH = 64


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in JSON text, counted over its brackets outside strings without parsing (and
    without recursing: the text may nest as deep as it is long). Exact for valid JSON; for invalid JSON it is exact
    up to the first error, which is as far as a parser reads."""
    import numpy as np

    # inside a string a backslash starts a two-byte escape: drop `\\` pairs, then escaped quotes, so every `"` left
    # opens or closes a string (a backslash run starts at an escape's boundary, so pairing left to right is exact)
    b = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    quotes = np.flatnonzero(b == 0x22)
    brackets = np.flatnonzero((b == 0x5B) | (b == 0x7B) | (b == 0x5D) | (b == 0x7D))
    outside = brackets[np.searchsorted(quotes, brackets) % 2 == 0]  # an even number of quotes before: not in a string
    if outside.size == 0:
        return 0
    steps = np.where((b[outside] == 0x5B) | (b[outside] == 0x7B), 1, -1)
    return max(int(np.cumsum(steps).max()), 0)


def nests_deeper(raw: bytes, limit: int = MAX_JSON_FILE_DEPTH) -> bool:
    """Whether arrays and objects in JSON text nest more than `limit` deep (no scan where there are fewer brackets)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # every bracket holds one of these bytes, in any encoding
        return False
    import json

    encoding = json.detect_encoding(raw)  # as json.loads reads bytes
    if not encoding.startswith("utf-8"):  # UTF-16/32: a character's bytes may include a quote's (U+4E22: 22 4E)
        try:
            raw = raw.decode(encoding).encode("utf-8", "surrogatepass")
        except UnicodeError:
            return False  # json.loads refuses it before it parses anything
    return json_depth(raw) > limit


def load_json_bytes(raw: bytes, max_depth: int = MAX_JSON_FILE_DEPTH) -> Any:
    """JSON text parsed, its nesting checked first (`json_depth`); ValueError saying what is wrong."""
    import json

    if nests_deeper(raw, max_depth):
        raise ValueError(f"nested more than {max_depth} levels deep")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not valid JSON ({e})") from None


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; ValueError saying what is wrong (callers add the file's role)."""
    try:
        data = load_json_bytes(path.read_bytes())
    except OSError as e:
        raise ValueError(f"cannot be read ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    return data
