"""Stored responses of /v1/responses (`store: true`, OpenAI's default) in one SQLite file (`--responses-db PATH`).

A row is one response under its API key's *name* ("anonymous" on a server without keys; the key itself is
never stored): the Response object as it was answered, and its context, the input items it was generated
from (those of the response it continued, that response's output, then its own input). Another key's id
reads as absent, so GET, DELETE, input_items and previous_response_id answer 404 for it, as for an id that
never existed. Past MAX_PER_OWNER an owner's oldest responses are dropped (OpenAI keeps them 30 days).

Calls are blocking and short: routes run them with asyncio.to_thread, one at a time through a lock.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmserve.utils import open_sqlite, user_data_dir

MAX_PER_OWNER = 10_000


@dataclass(frozen=True)
class StoredResponse:
    """A Response object and the input items it was generated from (continuations included)."""

    response: dict[str, Any]
    context: list[dict[str, Any]]


def default_db_path() -> Path:
    """$XDG_DATA_HOME/lmserve/responses.sqlite3 (~/.local/share/... when unset): kept across restarts."""
    return user_data_dir() / "responses.sqlite3"


class ResponseStore:
    """Put, get and delete responses per owner; OSError / sqlite3.Error when the file cannot be opened."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # one connection, used from the thread pool's threads
        self._db = open_sqlite(path, (
            "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL, "
            "response TEXT NOT NULL, context TEXT NOT NULL)",
            "CREATE INDEX IF NOT EXISTS responses_by_owner ON responses (owner, created)"))

    def put(self, owner: str, stored: StoredResponse) -> None:
        """Save a response (replacing one of the same id); drops the owner's oldest past MAX_PER_OWNER."""
        row = (stored.response["id"], owner, time.time(), json.dumps(stored.response, ensure_ascii=False),
               json.dumps(stored.context, ensure_ascii=False))
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses (id, owner, created, response, context) "
                             "VALUES (?, ?, ?, ?, ?)", row)
            self._db.execute("DELETE FROM responses WHERE owner = ? AND id NOT IN (SELECT id FROM responses "
                             "WHERE owner = ? ORDER BY created DESC LIMIT ?)", (owner, owner, MAX_PER_OWNER))
            self._db.commit()

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The owner's response by that id, or None (unknown, deleted, or another owner's)."""
        with self._lock:
            row = self._db.execute("SELECT response, context FROM responses WHERE id = ? AND owner = ?",
                                   (response_id, owner)).fetchone()
        return None if row is None else StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str, owner: str) -> bool:
        """Delete one of the owner's responses; False when there is none by that id."""
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
            self._db.commit()
        return cur.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
