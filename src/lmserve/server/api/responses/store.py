"""Stored responses of /v1/responses (`store: true`, OpenAI's default) in one SQLite file (`--responses-db PATH`).

A row is one turn under its API key's *name* ("anonymous" on a server without keys; the key itself is never
stored): the Response object as it was answered, the input items of that turn only, and a link to the response
it continued (`previous_response_id`). A response's context (what it was generated from) is rebuilt by walking
the links: each earlier turn's input and output, then its own input. So a chain of N turns stores N turns, not the
N²/2 items that copying each context would (issue 47), and its length is bounded (StorageQuota.response_chain).

Another key's id reads as absent, so GET, DELETE, input_items and previous_response_id answer 404 for it, as for
an id that never existed. Past the key's quota (StorageQuota.responses, .response_bytes) its oldest responses are
dropped, as OpenAI expires them. A dropped or deleted response is hidden (a 404) while later turns still link to
it, and removed with the last of them.

Calls are blocking and short: routes run them with asyncio.to_thread, one at a time through a lock.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmserve.files import open_sqlite, user_data_dir
from lmserve.server.quotas import StorageQuota

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS turns (id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL, "
    "previous TEXT, depth INTEGER NOT NULL, response TEXT NOT NULL, input TEXT NOT NULL, bytes INTEGER NOT NULL, "
    "hidden INTEGER NOT NULL DEFAULT 0)",
    "CREATE INDEX IF NOT EXISTS turns_by_owner ON turns (owner, hidden, created)",
    "CREATE INDEX IF NOT EXISTS turns_by_previous ON turns (previous)",
)
# Responses stored before turns were linked kept their whole context: each becomes a first turn whose input is it.
_MIGRATE = ("INSERT OR IGNORE INTO turns (id, owner, created, previous, depth, response, input, bytes) SELECT id, "
            "owner, created, NULL, 1, response, context, "
            "LENGTH(CAST(response AS BLOB)) + LENGTH(CAST(context AS BLOB)) FROM responses")
# The turns of one chain, first turn first.
_CHAIN = ("WITH RECURSIVE chain(id, previous, response, input, depth) AS ("
          "SELECT id, previous, response, input, depth FROM turns WHERE id = ? AND owner = ? AND hidden = 0 "
          "UNION ALL SELECT t.id, t.previous, t.response, t.input, t.depth FROM turns t JOIN chain c "
          "ON t.id = c.previous AND t.owner = ?) SELECT response, input, depth FROM chain ORDER BY depth")


@dataclass(frozen=True)
class StoredResponse:
    """A Response object, the input items it was generated from (earlier turns included) and its turn number."""

    response: dict[str, Any]
    context: list[dict[str, Any]]
    depth: int = 1  # 1: it continued no response


def default_db_path() -> Path:
    """$XDG_DATA_HOME/lmserve/responses.sqlite3 (~/.local/share/... when unset): kept across restarts."""
    return user_data_dir() / "responses.sqlite3"


class ResponseStore:
    """Put, get and delete responses per owner; OSError / sqlite3.Error when the file cannot be opened."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # one connection, used from the thread pool's threads
        self._db = open_sqlite(path, SCHEMA)
        if self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'responses'").fetchone():
            self._db.execute(_MIGRATE)
            self._db.execute("DROP TABLE responses")
            self._db.commit()

    def put(self, owner: str, response: dict[str, Any], items: list[dict], previous: StoredResponse | None,
            quota: StorageQuota) -> None:
        """Save a turn: `items` is its own input, `previous` the response it continued (None: a first turn);
        then drop the owner's oldest responses past `quota`."""
        input_text = json.dumps(items, ensure_ascii=False)
        response_text = json.dumps(response, ensure_ascii=False)
        size = len(input_text.encode()) + len(response_text.encode())
        with self._lock:
            link = previous is not None and self._db.execute(
                "SELECT 1 FROM turns WHERE id = ? AND owner = ?", (previous.response["id"], owner)).fetchone()
            if previous is not None and not link:  # removed meanwhile: keep the whole context in this turn
                input_text = json.dumps(previous.context + previous.response["output"] + items, ensure_ascii=False)
            self._db.execute("INSERT OR REPLACE INTO turns (id, owner, created, previous, depth, response, input, "
                             "bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (response["id"], owner, time.time(), previous.response["id"] if link else None,
                              previous.depth + 1 if previous is not None else 1, response_text, input_text, size))
            self._trim(owner, quota)
            self._db.commit()

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The owner's response by that id, or None (unknown, deleted, or another owner's)."""
        with self._lock:
            rows = self._db.execute(_CHAIN, (response_id, owner, owner)).fetchall()
        if not rows:
            return None
        context: list[dict[str, Any]] = []
        for response, items, _ in rows[:-1]:
            context += json.loads(items) + json.loads(response)["output"]
        response, items, depth = rows[-1]
        return StoredResponse(json.loads(response), context + json.loads(items), depth)

    def delete(self, response_id: str, owner: str) -> bool:
        """Delete one of the owner's responses; False when there is none by that id."""
        with self._lock:
            cur = self._db.execute("UPDATE turns SET hidden = 1 WHERE id = ? AND owner = ? AND hidden = 0",
                                   (response_id, owner))
            self._collect(owner)
            self._db.commit()
        return cur.rowcount > 0

    def usage(self, owner: str) -> tuple[int, int]:
        """(responses the owner can read, bytes its turns take, hidden ones still linked to included)."""
        with self._lock:
            (count,) = self._db.execute("SELECT COUNT(*) FROM turns WHERE owner = ? AND hidden = 0",
                                        (owner,)).fetchone()
            (size,) = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM turns WHERE owner = ?",
                                       (owner,)).fetchone()
        return count, size

    def _trim(self, owner: str, quota: StorageQuota) -> None:
        """Hide the owner's oldest responses until it is within its quota (the lock held)."""
        count_limit, bytes_limit = quota.responses, quota.response_bytes
        while True:
            (count,) = self._db.execute("SELECT COUNT(*) FROM turns WHERE owner = ? AND hidden = 0",
                                        (owner,)).fetchone()
            (size,) = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM turns WHERE owner = ?",
                                       (owner,)).fetchone()
            over = (count_limit is not None and count > count_limit) or (bytes_limit is not None and size > bytes_limit)
            if not over or count == 0:
                return
            excess = count - count_limit if count_limit is not None and count > count_limit else 1
            self._db.execute("UPDATE turns SET hidden = 1 WHERE id IN (SELECT id FROM turns WHERE owner = ? AND "
                             "hidden = 0 ORDER BY created LIMIT ?)", (owner, excess))
            self._collect(owner)

    def _collect(self, owner: str) -> None:
        """Remove hidden turns no turn links to any more, down each chain (the lock held)."""
        while self._db.execute("DELETE FROM turns WHERE owner = ? AND hidden = 1 AND NOT EXISTS (SELECT 1 FROM "
                               "turns t WHERE t.previous = turns.id)", (owner,)).rowcount:
            pass

    def close(self) -> None:
        with self._lock:
            self._db.close()
