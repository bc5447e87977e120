"""The playground's saved shares in one SQLite file (`--playground-db PATH`).

A share is a JSON document (prompt, parameters, output with its token logprobs) under a random id of
128 bits: the id is the permalink's capability, so any caller with a valid API key may read a share whose
id it has been given. Listing and deleting are limited to the shares saved under the caller's API key
*name* ("anonymous" on a server without keys); the key itself is never stored. How many shares, and how many
bytes of them, a key may keep is its StorageQuota's (shares, share_bytes); past it a new share is refused.

Calls are blocking and short: routes run them with asyncio.to_thread, one at a time through a lock.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmserve.files import open_sqlite, user_data_dir
from lmserve.server.quotas import StorageQuota, check_room

LIST_LIMIT = 200  # newest first


@dataclass(frozen=True)
class ShareSummary:
    """One row of a listing: what the saved-examples list shows."""

    id: str
    title: str
    mode: str
    created: float


def default_db_path() -> Path:
    """$XDG_DATA_HOME/lmserve/playground.sqlite3 (~/.local/share/... when unset): user data, kept across restarts."""
    return user_data_dir() / "playground.sqlite3"


def new_share_id() -> str:
    """22 URL-safe characters from 16 random bytes: unguessable, and short enough for a link."""
    return secrets.token_urlsafe(16)


class ShareStore:
    """Create, read, list and delete shares; OSError / sqlite3.Error when the file cannot be opened."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # one connection, used from the thread pool's threads
        self._db = open_sqlite(path, (
            "CREATE TABLE IF NOT EXISTS shares (id TEXT PRIMARY KEY, owner TEXT NOT NULL, title TEXT NOT NULL, "
            "mode TEXT NOT NULL, created REAL NOT NULL, body TEXT NOT NULL)",
            "CREATE INDEX IF NOT EXISTS by_owner ON shares (owner, created)"))

    def create(self, owner: str, title: str, mode: str, body: dict[str, Any], quota: StorageQuota) -> ShareSummary:
        """Save `body` (plain JSON data) under a new id; QuotaExceeded past the owner's quota."""
        share = ShareSummary(new_share_id(), title, mode, time.time())
        text = json.dumps(body, ensure_ascii=False)
        size = len(text.encode()) + len(title.encode())
        with self._lock:
            count, held = self._db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(CAST(body AS BLOB)) + LENGTH(CAST("
                                           "title AS BLOB))), 0) FROM shares WHERE owner = ?", (owner,)).fetchone()
            check_room("shares", count, held, size, quota.shares, quota.share_bytes)
            self._db.execute("INSERT INTO shares (id, owner, title, mode, created, body) VALUES (?, ?, ?, ?, ?, ?)",
                             (share.id, owner, title, mode, share.created, text))
            self._db.commit()
        return share

    def get(self, share_id: str) -> tuple[ShareSummary, dict[str, Any]] | None:
        """The share and its body, or None for an unknown id (whoever saved it)."""
        with self._lock:
            row = self._db.execute("SELECT id, title, mode, created, body FROM shares WHERE id = ?",
                                   (share_id,)).fetchone()
        return None if row is None else (ShareSummary(*row[:4]), json.loads(row[4]))

    def list(self, owner: str) -> list[ShareSummary]:
        """The owner's newest LIST_LIMIT shares, newest first."""
        with self._lock:
            rows = self._db.execute("SELECT id, title, mode, created FROM shares WHERE owner = ? "
                                    "ORDER BY created DESC LIMIT ?", (owner, LIST_LIMIT)).fetchall()
        return [ShareSummary(*row) for row in rows]

    def delete(self, share_id: str, owner: str) -> bool:
        """Delete one of the owner's shares; False when there is none by that id (or it is someone else's)."""
        with self._lock:
            cur = self._db.execute("DELETE FROM shares WHERE id = ? AND owner = ?", (share_id, owner))
            self._db.commit()
        return cur.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
