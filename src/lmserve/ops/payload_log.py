"""Payload log: one JSON line per finished request, written off the request path.

`submit()` runs on the event loop and only decides sampling and enqueues; a writer thread redacts,
caps and serializes each record and appends it with one write() of the whole line, so a crash
leaves at most the last line incomplete and every earlier line readable. Files rotate by size
(PATH -> PATH.1 -> ... PATH.N) before a line that would not fit, so no line is split across files.
`close()` (graceful shutdown) writes every queued line before it returns.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from lmserve.ops.record import RequestRecord

log = logging.getLogger(__name__)

# Redacted by default: e-mail addresses, OpenAI/Anthropic/HF/GitHub/AWS-style keys, bearer tokens, JWTs.
DEFAULT_REDACTIONS: tuple[str, ...] = (
    r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}",
    r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}",
    r"\bhf_[A-Za-z0-9]{20,}",
    r"\bgh[pousr]_[A-Za-z0-9]{20,}",
    r"\bAKIA[0-9A-Z]{16}\b",
    r"\b(?i:bearer)\s+[A-Za-z0-9._~+/=-]{8,}",
    r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",
)
REDACTED = "[REDACTED]"
SECRET_KEYS = re.compile(r"(?i)^(authorization|api[_-]?key|password|secret|access_token|auth_token)$")  # never written
MAX_QUEUED = 10_000  # beyond this, lines are dropped (counted) rather than growing memory without bound
DROP_REASONS = ("sampled_out", "queue_full", "write_error")
_STOP = object()


class PayloadLogger:
    """Queue + writer thread appending redacted JSON lines to `path`, rotated by size."""

    def __init__(self, path: str | os.PathLike, sample_rate: float = 1.0, redact: Sequence[str] = DEFAULT_REDACTIONS,
                 max_field_chars: int = 10_000, max_bytes: int = 100 * 2**20, backups: int = 5,
                 registry: CollectorRegistry | None = None, seed: int | None = None) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"payload log sample rate must be within [0, 1], got {sample_rate}")
        if max_field_chars < 1 or max_bytes < 1 or backups < 0:
            raise ValueError("payload log max_field_chars and max_bytes must be positive, backups >= 0")
        patterns = []
        for p in redact:
            try:
                patterns.append(re.compile(p))
            except re.error as e:
                raise ValueError(f"payload log redaction {p!r} is not a valid regex: {e}") from None
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.sample_rate, self.max_field_chars = sample_rate, max_field_chars
        self.max_bytes, self.backups = max_bytes, backups
        self._redact = re.compile("|".join(f"(?:{p.pattern})" for p in patterns)) if patterns else None
        self._random = random.Random(seed)
        self._queue: queue.Queue = queue.Queue()
        self._file = open(self.path, "ab")  # noqa: SIM115 - owned by the writer thread until close()
        self._size = self._file.tell()
        if self._size and not _ends_with_newline(self.path):  # a crash left a partial line: end it
            self._file.write(b"\n")
            self._size += 1
        self._closed = False
        self._metrics(registry)
        self._thread = threading.Thread(target=self._run, name="lmserve-payload-log", daemon=True)
        self._thread.start()

    def _metrics(self, registry: CollectorRegistry | None) -> None:
        r = registry or CollectorRegistry()
        self.written = Counter("lmserve:payload_log_lines_written", "Payload log lines written", registry=r)
        self.dropped = Counter("lmserve:payload_log_lines_dropped", "Payload log lines not written, by reason",
                               ["reason"], registry=r)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        self.depth = Gauge("lmserve:payload_log_queue_depth", "Lines waiting for the writer thread", registry=r)
        self.depth.set_function(self._queue.qsize)

    # -- the request path (event loop): O(1), never blocks or raises -----------------------------

    def submit(self, record: RequestRecord) -> None:
        if self._closed:
            return
        if self.sample_rate < 1.0 and self._random.random() >= self.sample_rate:
            self.dropped.labels("sampled_out").inc()
            return
        if self._queue.qsize() >= MAX_QUEUED:
            self.dropped.labels("queue_full").inc()
            return
        self._queue.put(record.to_dict())  # a snapshot: the record is not touched after this

    def close(self, timeout: float = 30.0) -> None:
        """Write every queued line, then stop the writer and close the file."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("payload log writer did not finish within %.0f s; %d line(s) left", timeout,
                        self._queue.qsize())

    # -- the writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not _STOP:
                self._write(item)
        finally:
            self._file.close()

    def _write(self, item: dict[str, Any]) -> None:
        try:
            line = (json.dumps(self.clean(item), ensure_ascii=False, separators=(",", ":")) + "\n").encode()
            if self._size and self._size + len(line) > self.max_bytes:
                self._rotate()
            self._file.write(line)  # one write per whole line
            self._file.flush()
            self._size += len(line)
            self.written.inc()
        except Exception:  # noqa: BLE001 - a bad record or a full disk must not kill the writer
            self.dropped.labels("write_error").inc()
            log.exception("payload log write failed")

    def _rotate(self) -> None:
        self._file.close()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = open(self.path, "ab")  # noqa: SIM115
        self._size = 0

    def clean(self, value: Any) -> Any:
        """Drop secret-named keys, redact and cap every string, cap long lists (e.g. prompt token ids)."""
        if isinstance(value, str):
            if self._redact is not None:
                value = self._redact.sub(REDACTED, value)
            if len(value) > self.max_field_chars:
                cut = len(value) - self.max_field_chars
                value = value[:self.max_field_chars] + f"...[truncated {cut} chars]"
            return value
        if isinstance(value, dict):
            return {k: self.clean(v) for k, v in value.items() if not SECRET_KEYS.search(str(k))}
        if isinstance(value, (list, tuple)):
            items = [self.clean(v) for v in value[:self.max_field_chars]]
            if len(value) > self.max_field_chars:
                items.append(f"...[truncated {len(value) - self.max_field_chars} items]")
            return items
        return value


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
