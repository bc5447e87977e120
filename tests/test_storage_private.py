"""Everything the server stores is its user's alone (issue 47, finding 7: the response store, shares, the response
cache and batch files were 0644 in 0755 directories): each store exercised through the real server, under a
umask of 022, then every file under them is 0600 and every directory 0700."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from lmserve.files import open_sqlite
from tests.server_util import MODEL, free_port, running_server

KEY_A, KEY_B, ADMIN = "sk-team-a-0123456789abcdef", "sk-team-b-0123456789abcdef", "sk-ops-0123456789abcdef"
KEY_FILE = (f"keys:\n  - {{name: team-a, key: {KEY_A}}}\n  - {{name: team-b, key: {KEY_B}}}\n"
            f"  - {{name: ops, key: {ADMIN}, role: admin}}\n")
LONG = "Every file the server keeps is private to the user it runs as, whatever the umask says. " * 6


def modes(root: Path) -> dict[str, str]:
    """Every path under `root` (not root itself) -> its permission bits, octal."""
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.lstat().st_mode)) for p in sorted(root.rglob("*"))}


def test_every_store_writes_0600_files_in_0700_directories(tmp_path):
    root, data = tmp_path / "store", tmp_path / "store" / "xdg-data"
    old = data / "lmserve"  # an earlier version's default directory and share file: 0755 and 0644
    old.mkdir(parents=True, mode=0o755)
    old.chmod(0o755)
    (old / "playground.sqlite3").write_bytes(b"")
    (old / "playground.sqlite3").chmod(0o644)
    (tmp_path / "keys.yaml").write_text(KEY_FILE)
    args = ("--api-key-file", str(tmp_path / "keys.yaml"), "--kv-offload-dir", str(root / "kv"),
            "--response-cache", f"sqlite:{root / 'cache' / 'responses.sqlite'}")
    umask = os.umask(0o022)  # the usual one: what the server stored came out 0644 under it
    try:
        with running_server(*args, env={"XDG_DATA_HOME": str(data)}, headers={"Authorization": f"Bearer {ADMIN}"}) as s:
            exercise(s)
            found = modes(root)
    finally:
        os.umask(umask)
    ours = {p: m for p, m in found.items() if p != "xdg-data"}  # the user's XDG directory is theirs, not ours
    for kind in ("kv/", "cache/", "xdg-data/lmserve/batches/files/", "xdg-data/lmserve/batches/batches/"):
        assert any(p.startswith(kind) for p in ours), f"nothing stored under {kind}: {sorted(ours)}"
    for name in ("playground.sqlite3", "responses.sqlite3"):
        assert f"xdg-data/lmserve/{name}" in ours
    dirs = {p for p in ours if (root / p).is_dir()}
    assert {p: m for p, m in ours.items() if p in dirs and m != "0o700"} == {}
    assert {p: m for p, m in ours.items() if p not in dirs and m != "0o600"} == {}


def exercise(s) -> None:
    """One write into each store: a batch job (its input and results), a share, a stored response, a cached answer
    and KV blocks on disk."""
    a = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)
    line = ('{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "%s", '
            '"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}}\n' % MODEL)
    upload = a.files.create(file=("in.jsonl", line.encode()), purpose="batch")
    job = a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    share = httpx.post(s.url + "/playground/api/shares", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30,
                       json={"mode": "completion", "model": MODEL, "prompt": "Hi", "params": {},
                             "output": {"text": "Hello"}})
    assert share.status_code == 200, share.text
    a.responses.create(model=MODEL, input="Say hi", max_output_tokens=4)
    a.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=2, temperature=0)
    deadline = time.time() + 180
    while a.batches.retrieve(job.id).status != "completed" and time.time() < deadline:
        time.sleep(0.5)
    assert a.batches.retrieve(job.id).status == "completed"
    while s.metric("lmserve:kv_offload_stores_total", 'tier="disk"') < 1 and time.time() < deadline:
        time.sleep(0.2)  # the disk writer's queue drains
    assert s.metric("lmserve:kv_offload_stores_total", 'tier="disk"') >= 1


def test_sqlite_journals_take_the_databases_private_mode(tmp_path):
    """SQLite makes its -wal and -shm (and -journal) files with the database file's mode: a 0600 database keeps them
    0600 under any umask, with no process-wide umask change (other threads create files meanwhile)."""
    umask = os.umask(0o022)
    try:
        db = open_sqlite(tmp_path / "d" / "x.sqlite3", ("CREATE TABLE IF NOT EXISTS t (v TEXT)",))
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("INSERT INTO t VALUES ('x')")
        db.commit()
        found = modes(tmp_path)
        db.close()
    finally:
        os.umask(umask)
    assert found == {"d": "0o700", "d/x.sqlite3": "0o600", "d/x.sqlite3-wal": "0o600", "d/x.sqlite3-shm": "0o600"}


def test_a_symlink_at_a_database_path_is_refused_not_followed(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    (tmp_path / "db").mkdir(mode=0o700)
    os.symlink(target, tmp_path / "db" / "shares.sqlite3")
    with pytest.raises(OSError):
        open_sqlite(tmp_path / "db" / "shares.sqlite3", ("CREATE TABLE IF NOT EXISTS t (v TEXT)",))
    assert target.read_bytes() == b"precious"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by every user"):  # anyone could swap the file in it
        open_sqlite(shared / "x.sqlite3", ())
    assert not list(shared.iterdir())


@pytest.mark.parametrize("flag", ["--batch-dir", "--playground-db"])
def test_a_store_in_a_directory_every_user_may_write_is_refused_at_start(tmp_path, flag):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    value = str(shared) if flag == "--batch-dir" else str(shared / "shares.sqlite3")
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}  # the other stores' defaults: not the user's
    p = subprocess.run([sys.executable, "-m", "lmserve.cli", "serve", "--port", str(free_port()), flag, value], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "writable by every user" in p.stderr, p.stderr
