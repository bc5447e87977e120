"""Batch jobs in OpenAI's Batch API format: input lines, a resumable results file, and the runner.

One input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}`.
Each line's body goes through the route's own handling (`api/openai.answer`), at BATCH_PRIORITY so
interactive requests are admitted first. One output line per input line:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error": {"code", "message"} | null}`:
a refusal by the route is a response with the route's status and error body; a line that is not a request
at all (bad JSON, no body, another url) is an `error`.

Resumable: a result is appended and flushed as soon as its line finishes, so after a kill the custom_ids
already in the results are skipped on the next run; a torn last line (killed mid-write) is cut off first.
`lmserve run-batch` and the server's /v1/batches both run lines through `run_lines`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Iterator

from lmserve.files import append_private, user_data_dir
from lmserve.ops.record import RequestRecord
from lmserve.request import BATCH_PRIORITY
from lmserve.server.api.openai.routes import BATCH_ENDPOINTS, Caller, answer
from lmserve.server.errors import APIError, error_body
from lmserve.server.protocol import load_json
from lmserve.server.state import ServerState

log = logging.getLogger("lmserve.batch")

MAX_CUSTOM_ID = 512  # characters; longer ids are a bad line (they are echoed in every result)


class DuplicateCustomId(ValueError):
    """Two input lines share a custom_id: refused before any line runs (results are keyed by it)."""


@dataclass(frozen=True)
class Line:
    """One input line: a request to run, or `problem` saying why it is not one (then url/body may be empty)."""

    number: int  # 1-based line number in the input
    custom_id: str | None  # None only when the line has no usable custom_id
    url: str = ""
    body: dict[str, Any] | None = None  # the request's JSON object (None with a problem that is not the body)
    problem: str | None = None

    @property
    def key(self) -> str:
        """What results are matched by: the custom_id, or the line number for a line without one."""
        return self.custom_id if self.custom_id is not None else f"#line {self.number}"


def parse_line(number: int, raw: bytes, endpoint: str | None = None) -> Line:
    """One input line; `endpoint`, when given, is the only url allowed (a /v1/batches job's endpoint)."""
    try:
        data = load_json(raw)
    except APIError as e:
        return Line(number, None, problem=f"line {number}: {e.message.replace('request body', 'line')}")
    if not isinstance(data, dict):
        return Line(number, None, problem=f"line {number}: not a JSON object")
    cid = data.get("custom_id")
    if not isinstance(cid, str) or not 0 < len(cid) <= MAX_CUSTOM_ID:
        return Line(number, None, problem=f"line {number}: custom_id must be a string of 1..{MAX_CUSTOM_ID} characters")
    url, body = data.get("url"), data.get("body")
    allowed = (endpoint,) if endpoint else tuple(BATCH_ENDPOINTS)
    problem = None
    if data.get("method", "POST") != "POST":
        problem = f"method must be POST, got {str(data.get('method'))[:20]!r}"
    elif url not in allowed:
        problem = f"url must be {' or '.join(allowed)}, got {str(url)[:60]!r}"
    elif not isinstance(body, dict):
        problem = "body must be a JSON object"
    return Line(number, cid, url, body if isinstance(body, dict) else None, problem and f"line {number}: {problem}")


def read_lines(raw_lines: Iterable[bytes], endpoint: str | None = None) -> list[Line]:
    """Every non-blank input line, parsed; DuplicateCustomId when two lines share a custom_id."""
    lines, seen = [], {}
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        line = parse_line(number, raw, endpoint)
        if line.custom_id is not None:
            if line.custom_id in seen:
                raise DuplicateCustomId(f"custom_id {line.custom_id[:80]!r} appears on lines {seen[line.custom_id]} "
                                        f"and {number}; every custom_id must be unique")
            seen[line.custom_id] = number
        lines.append(line)
    return lines


def read_input(path: Path, endpoint: str | None = None) -> list[Line]:
    with open(path, "rb") as f:
        return read_lines(f, endpoint)


class ResultsFile:
    """An append-only JSONL file of results, flushed line by line; knows which keys it already holds.

    Opening repairs a torn tail: bytes after the last newline (a write cut by a kill) are truncated, so every
    line in the file is whole. flush() hands each line to the OS, which keeps it if the process is killed
    (only a machine crash could lose it; fsync per line would cost a disk round trip per request).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[str] = set()
        self.counts = {"completed": 0, "failed": 0}
        self._file = None
        if path.exists():
            self._repair_and_read()

    def _repair_and_read(self) -> None:
        data = self.path.read_bytes()
        whole = data[:data.rfind(b"\n") + 1]
        if len(whole) != len(data):
            log.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", self.path,
                        len(data) - len(whole))
            with open(self.path, "r+b") as f:
                f.truncate(len(whole))
        for raw in whole.splitlines():
            try:
                result = json.loads(raw)
            except ValueError:
                continue  # not ours: a line that never was whole JSON is not counted as done
            if isinstance(result, dict):
                self._count(result)

    def _count(self, result: dict) -> None:
        self.done.add(result_key(result))
        self.counts["completed" if succeeded(result) else "failed"] += 1

    def append(self, result: dict) -> None:
        if self._file is None:  # 0600: a batch job's results are its key's alone (`run-batch` keeps the same)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = append_private(self.path)
        self._file.write(json.dumps(result, ensure_ascii=False).encode() + b"\n")
        self._file.flush()
        self._count(result)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def result_key(result: dict) -> str:
    """Line.key of the line a result answers (a result for a line without custom_id carries its `line`)."""
    cid = result.get("custom_id")
    return cid if isinstance(cid, str) else f"#line {result.get('line')}"


def succeeded(result: dict) -> bool:
    return result.get("error") is None and (result.get("response") or {}).get("status_code") == 200


@dataclass
class LineResult:
    """A finished line: its result line, and the tokens it took (for the progress bar)."""

    result: dict
    prompt_tokens: int = 0
    completion_tokens: int = 0
    images: int = 0  # image parts of an answered chat line (for images/s)


async def run_line(st: ServerState, line: Line, key_name: str) -> LineResult:
    """Answer one line as its route would (at batch priority) and shape the result line."""
    rid = f"batch_req_{uuid.uuid4().hex}"
    if line.problem is not None:
        result = {"id": rid, "custom_id": line.custom_id, "response": None,
                  "error": {"code": "invalid_request", "message": line.problem}}
        if line.custom_id is None:
            result["line"] = line.number  # how a rerun recognises this line as done
        return LineResult(result)
    record = RequestRecord(rid, line.url)
    record.key_name = key_name
    try:
        status, body = await answer(st, line.url, line.body, Caller(record, priority=BATCH_PRIORITY))
    except Exception as e:  # noqa: BLE001 - a bug: the line gets the 500 the HTTP route would, the log the traceback
        log.exception("batch line %s failed", line.key[:80])
        status, body = 500, error_body(APIError(500, f"internal error ({type(e).__name__})"))
    record.status, record.e2e_s = status, time.monotonic() - record.start
    st.tenants.settle(record)  # the key's concurrency slot and unused tokens back, as the HTTP middleware does
    st.ops.finish(record)  # payload log, traces, drift: as for an HTTP request
    usage = (body.get("usage") or {}) if status == 200 else {}
    response = {"status_code": status, "request_id": record.request_id if status == 200 else rid, "body": body}
    return LineResult({"id": rid, "custom_id": line.custom_id, "response": response, "error": None},
                      usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                      count_images(line.body) if status == 200 else 0)


def count_images(body: dict | None) -> int:
    """The `image_url` parts of a chat body's messages (a refused line's count is never used)."""
    messages = (body or {}).get("messages")
    if not isinstance(messages, list):
        return 0
    return sum(isinstance(m, dict) and isinstance(m.get("content"), list)
               and sum(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
               for m in messages)


async def run_lines(st: ServerState, lines: list[Line], key_name: str, window: int,
                    retry: Callable[[LineResult], bool] = lambda r: False) -> AsyncIterator[LineResult]:
    """Run `lines` with up to `window` in flight; yield each result as it finishes (in finishing order).

    The window keeps the engine's waiting queue fed (continuous batching refills a slot the step a
    sequence ends) without tokenizing a whole file up front. `retry(result)` true (a 429 or queue-full
    503 on a busy server) runs the line again after a short pause instead of yielding it.
    """
    pending: Iterator[Line] = iter(lines)
    tasks: set[asyncio.Task] = set()

    def submit() -> bool:
        line = next(pending, None)
        if line is not None:
            tasks.add(asyncio.create_task(_until_accepted(st, line, key_name, retry)))
        return line is not None

    try:
        while len(tasks) < window and submit():
            pass
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                tasks.discard(task)
                submit()
                yield task.result()
    finally:
        for task in tasks:  # cancelled or stopped early: abort what is still running
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


async def _until_accepted(st: ServerState, line: Line, key_name: str, retry: Callable[[LineResult], bool]) -> LineResult:
    delay = 0.2
    while True:
        result = await run_line(st, line, key_name)
        if not retry(result):
            return result
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


def pending_lines(lines: list[Line], done: set[str]) -> list[Line]:
    """The lines whose results are not in the results file yet."""
    return [line for line in lines if line.key not in done]


def default_batch_dir() -> Path:
    """Where `serve` keeps uploaded files and batch jobs unless --batch-dir says: the user's data dir."""
    return user_data_dir() / "batches"
