"""Uploaded files and batch jobs on disk (under --batch-dir), so both survive a server restart.

    files/<file-id>.json     the file object (OpenAI's fields, plus its owner: the API key's name)
    files/<file-id>.jsonl    its content
    batches/<batch-id>.json  the job object

Every object is rewritten whole through a temporary file and os.replace, so a kill leaves the old or the
new version, never half of one. A job's results are appended to its output and error files' content
from the start (ids chosen at creation); their file objects are written only when the job ends, which
is what makes them visible. Directories are created on the first write: a server that never sees a
batch leaves nothing behind. Everything is private to the server's user: files 0600 (written through
unpredictable O_EXCL | O_NOFOLLOW temporary names), directories 0700 (utils.private_dir). A key's files (its
uploads and its jobs' results) count against its StorageQuota (files, file_bytes): past it an upload is refused.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmserve.files import lmserve_dirs, private_dir, write_private
from lmserve.server.quotas import StorageQuota, check_room

_ID = re.compile(r"^(file-|batch_)[0-9a-f]{32}$")  # ids name files on disk: nothing else may reach a path
TERMINAL = ("completed", "failed", "cancelled", "expired")


@dataclass
class StoredFile:
    """An uploaded file (purpose "batch") or a job's results ("batch_output")."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    owner: str  # the API key's name: other keys get 404

    def to_openai(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "status_details": None}


@dataclass
class BatchJob:
    """A batch job as OpenAI's Batch object describes it; `owner` and the results' ids are ours."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    owner: str
    output_id: str  # where results with status 200 go (exposed as output_file_id once the job ends)
    error_id: str  # where the others go (error_file_id)
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "validating"
    metadata: dict[str, str] | None = None
    errors: list[dict] | None = None  # validation errors of the input file (then status "failed")
    request_counts: dict[str, int] = field(default_factory=lambda: {"total": 0, "completed": 0, "failed": 0})
    output_file_id: str | None = None
    error_file_id: str | None = None
    times: dict[str, int] = field(default_factory=dict)  # in_progress_at, finalizing_at, completed_at, ...

    def mark(self, status: str) -> None:
        """Move to `status`, stamping its `<status>_at` time (as OpenAI's object has one per state)."""
        self.status = status
        self.times[f"{status}_at"] = int(time.time())

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def to_openai(self) -> dict:
        stamps = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
                  "cancelled_at")
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "input_file_id": self.input_file_id,
                "completion_window": self.completion_window, "status": self.status, "created_at": self.created_at,
                "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "errors": {"object": "list", "data": self.errors} if self.errors else None,
                "request_counts": dict(self.request_counts), "metadata": self.metadata, "expires_at": None,
                **{k: self.times.get(k) for k in stamps}}


class BatchStore:
    """Files and jobs under one directory; reads and writes whole objects (small: the contents are separate)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.files_dir, self.jobs_dir = self.root / "files", self.root / "batches"
        self._lock = threading.Lock()  # the usage index, and an upload's check with its write
        self._usage: dict[str, list[int]] | None = None  # owner -> [files, bytes], counted on first use

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}{uuid.uuid4().hex}"

    def content_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def private(self, directory: Path) -> Path:
        """`directory` (files_dir or jobs_dir) made 0700 under a root that is checked (and lmserve's default one
        tightened) first; PermissionError for a root every user may write."""
        private_dir(self.root, own=self.root in lmserve_dirs())
        return private_dir(directory, own=True)

    def add_file(self, data: bytes, filename: str, purpose: str, owner: str,
                 quota: StorageQuota | None = None) -> StoredFile:
        """Store an upload; QuotaExceeded when it would take the owner past `quota` (None: no limit)."""
        f = StoredFile(self.new_id("file-"), len(data), int(time.time()), filename[:255], purpose, owner)
        with self._lock:
            if quota is not None:
                held, held_bytes = self._owner_usage(owner)
                check_room("files", held, held_bytes, len(data), quota.files, quota.file_bytes)
            self.private(self.files_dir)
            write_private(self.content_path(f.id), data)
            self._save_file(f)
        return f

    def save_file(self, f: StoredFile) -> None:
        """Write a file object (a job's results, made visible when it ends); counted against its owner."""
        with self._lock:
            self._save_file(f)

    def _save_file(self, f: StoredFile) -> None:
        path = self.private(self.files_dir) / f"{f.id}.json"
        new = not path.exists()
        write_private(path, json.dumps(asdict(f)).encode())
        if new and self._usage is not None:
            self._usage[f.owner][0] += 1
            self._usage[f.owner][1] += f.bytes

    def _owner_usage(self, owner: str) -> tuple[int, int]:
        if self._usage is None:  # once per process: every file object read (they are small)
            self._usage = defaultdict(lambda: [0, 0])
            for path in self.files_dir.glob("file-*.json") if self.files_dir.is_dir() else ():
                data = _read(self.files_dir, path.stem)
                if isinstance(data, dict) and isinstance(data.get("owner"), str):
                    self._usage[data["owner"]][0] += 1
                    self._usage[data["owner"]][1] += int(data.get("bytes") or 0)
        held = self._usage.get(owner, (0, 0))
        return held[0], held[1]

    def get_file(self, file_id: str, owner: str) -> StoredFile | None:
        data = _read(self.files_dir, file_id)
        f = StoredFile(**data) if data is not None else None
        return f if f is not None and f.owner == owner else None

    def delete_file(self, f: StoredFile) -> None:
        with self._lock:
            meta = self.files_dir / f"{f.id}.json"
            if meta.exists() and self._usage is not None:
                self._usage[f.owner][0] -= 1
                self._usage[f.owner][1] -= f.bytes
            for path in (meta, self.content_path(f.id)):
                path.unlink(missing_ok=True)

    def save_job(self, job: BatchJob) -> None:
        write_private(self.private(self.jobs_dir) / f"{job.id}.json", json.dumps(asdict(job)).encode())

    def get_job(self, job_id: str, owner: str | None) -> BatchJob | None:
        """The job, if `owner` may see it (None: any owner; the runner's own reads)."""
        data = _read(self.jobs_dir, job_id)
        job = BatchJob(**data) if data is not None else None
        return job if job is not None and owner in (None, job.owner) else None

    def jobs(self, owner: str | None = None) -> list[BatchJob]:
        """Every job (of `owner`), newest first."""
        if not self.jobs_dir.is_dir():
            return []
        found = [self.get_job(p.stem, owner) for p in self.jobs_dir.glob("batch_*.json")]
        return sorted((j for j in found if j is not None), key=lambda j: (j.created_at, j.id), reverse=True)


def valid_id(value: str) -> bool:
    return _ID.match(value) is not None


def _read(directory: Path, object_id: str) -> Any:
    if not valid_id(object_id):
        return None
    try:
        return json.loads((directory / f"{object_id}.json").read_bytes())
    except (OSError, ValueError):
        return None

