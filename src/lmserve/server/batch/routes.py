"""OpenAI's Files and Batch routes, thin: /v1/files (upload, get, content, delete) and /v1/batches.

Every object belongs to the API key that created it: another key gets 404, as for an id that does not
exist. The work is in store.py (disk) and jobs.py (running jobs).
"""

from __future__ import annotations

import asyncio
from typing import cast

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import FileResponse

from lmserve.server.api.openai.routes import BATCH_ENDPOINTS
from lmserve.server.batch.jobs import BatchManager
from lmserve.server.batch.store import BatchJob, StoredFile
from lmserve.server.errors import APIError
from lmserve.server.protocol import BatchCreateRequest, parse_body
from lmserve.server.quotas import QuotaExceeded
from lmserve.server.router import Router
from lmserve.server.state import key_name_of, quota_of, state_of

router = Router()
MAX_LIST = 100  # jobs per page of GET /v1/batches


@router.post("/v1/files")
async def upload_file(request: Request) -> dict:
    store, owner = _manager(request).store, key_name_of(request)
    file, purpose = await _upload(request)
    if purpose != "batch":
        raise APIError(400, f"purpose must be 'batch' (the only kind of file this server uses), got {purpose[:40]!r}",
                       param="purpose")
    data = await file.read()
    try:
        stored = await asyncio.to_thread(store.add_file, data, file.filename or "upload.jsonl", purpose, owner,
                                         quota_of(request))
    except QuotaExceeded as e:
        raise APIError(400, str(e), param="file", code="quota_exceeded") from None
    return stored.to_openai()


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> dict:
    return _file(request, file_id).to_openai()


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> dict:
    f = _file(request, file_id)
    _manager(request).store.delete_file(f)
    return {"id": f.id, "object": "file", "deleted": True}


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> FileResponse:
    f = _file(request, file_id)
    path = _manager(request).store.content_path(f.id)
    if not path.exists():
        raise _not_found("file", file_id)
    return FileResponse(path, media_type="application/octet-stream", filename=f.filename)


@router.post("/v1/batches")
async def create_batch(request: Request) -> dict:
    manager, owner = _manager(request), key_name_of(request)
    req = parse_body(await request.body(), BatchCreateRequest)
    if req.endpoint not in BATCH_ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {req.endpoint[:60]!r}",
                       param="endpoint")
    source = manager.store.get_file(req.input_file_id, owner)
    if source is None or source.purpose != "batch":
        raise _not_found("file", req.input_file_id, param="input_file_id")
    new = manager.store.new_id
    job = BatchJob(new("batch_"), req.endpoint, source.id, req.completion_window, owner, new("file-"), new("file-"),
                   metadata=req.metadata)
    manager.submit(job)
    return job.to_openai()


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> dict:
    if not 1 <= limit <= MAX_LIST:
        raise APIError(400, f"limit must be in 1..{MAX_LIST}, got {limit}", param="limit")
    jobs = _manager(request).store.jobs(key_name_of(request))
    if after is not None:  # the page after that job (newest first); an unknown id is an empty page
        ids = [j.id for j in jobs]
        jobs = jobs[ids.index(after) + 1:] if after in ids else []
    page = jobs[:limit]
    return {"object": "list", "data": [j.to_openai() for j in page], "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None, "has_more": len(jobs) > limit}


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> dict:
    return _job(request, batch_id).to_openai()


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> dict:
    return _manager(request).cancel(_job(request, batch_id)).to_openai()


def _manager(request: Request) -> BatchManager:
    manager = state_of(request).batches
    if manager is None:
        raise APIError(404, "batch jobs are off on this server")
    return cast(BatchManager, manager)  # the middle types it by the calls it makes (state.BatchRunner)


def _file(request: Request, file_id: str) -> StoredFile:
    f = _manager(request).store.get_file(file_id, key_name_of(request))
    if f is None:
        raise _not_found("file", file_id)
    return f


def _job(request: Request, batch_id: str) -> BatchJob:
    job = _manager(request).store.get_job(batch_id, key_name_of(request))
    if job is None:
        raise _not_found("batch", batch_id)
    return job


def _not_found(kind: str, object_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no {kind} with id {object_id[:80]!r}", param=param, code="not_found")


async def _upload(request: Request) -> tuple[UploadFile, str]:
    """The `file` and `purpose` fields of a multipart/form-data body; 400 for anything else."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(400, "the body must be multipart/form-data with fields 'file' and 'purpose'")
    try:
        form = await request.form(max_files=1, max_fields=8)
    except (HTTPException, MultiPartException) as e:  # starlette wraps the parser's complaint in a 400
        raise APIError(400, f"malformed multipart body: {getattr(e, 'detail', None) or e}"[:300]) from None
    file, purpose = form.get("file"), form.get("purpose")
    if not isinstance(file, UploadFile):
        raise APIError(400, "the form has no file in its 'file' field", param="file")
    if not isinstance(purpose, str):
        raise APIError(400, "the form has no 'purpose' field", param="purpose")
    return file, purpose
