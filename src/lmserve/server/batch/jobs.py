"""BatchManager: runs /v1/batches jobs one at a time on the serving engine, behind interactive requests.

A job: validating (its input file read; duplicate custom_ids fail it) -> in_progress (lines run through
batch.run_lines at BATCH_PRIORITY, each result appended to the output or error file as it finishes)
-> finalizing -> completed. Cancel stops it at once (lines in flight are aborted; what finished is kept).

On restart, a job that was validating, in progress or finalizing resumes where it stopped: the results
files already hold the custom_ids that finished, and only the others run (batch.pending_lines). A
job that was cancelling is cancelled. When the server drains (SIGTERM), the running job is stopped
without writing the results of lines cut short, so they run again after the restart.
"""

from __future__ import annotations

import asyncio
import logging
import time

from lmserve.server.batch.lines import DuplicateCustomId, LineResult, ResultsFile, pending_lines, read_input, succeeded
from lmserve.server.batch.store import BatchJob, BatchStore, StoredFile
from lmserve.server.state import ServerState

log = logging.getLogger("lmserve.batch")
RESUMABLE = ("validating", "in_progress", "finalizing")
SAVE_EVERY_S = 0.5  # job object rewrites while running (the counts are rebuilt from the results on restart)


class BatchManager:
    """The queue of jobs and the one task running them."""

    def __init__(self, store: BatchStore, state: ServerState) -> None:
        self.store, self.state = store, state
        self._queue: asyncio.Queue[str] | None = None
        self._worker: asyncio.Task | None = None
        self._running: tuple[BatchJob, asyncio.Task] | None = None  # the job being run (the one object of it)
        self._cancelled: set[str] = set()  # job ids whose running task was cancelled by a client

    def start(self) -> None:
        """On the server's event loop: pick up the jobs a previous run left unfinished, then serve the queue."""
        self._queue = asyncio.Queue()
        for job in reversed(self.store.jobs()):  # oldest first
            if job.status == "cancelling":
                job.mark("cancelled")
                self.store.save_job(job)
            elif job.status in RESUMABLE:
                log.info("resuming batch %s (%s)", job.id, job.status)
                self._queue.put_nowait(job.id)
        self._worker = asyncio.create_task(self._serve())

    def stop(self) -> None:
        """The server drains: stop the running job where it is (it resumes after the restart)."""
        if self._worker is not None:
            self._worker.cancel()

    def submit(self, job: BatchJob) -> None:
        self.store.save_job(job)
        if self._queue is not None:
            self._queue.put_nowait(job.id)

    def cancel(self, job: BatchJob) -> BatchJob:
        """Cancel a job: a queued one at once, the running one once its task has stopped (status cancelling)."""
        running = self._running is not None and self._running[0].id == job.id
        if running:
            job = self._running[0]  # the runner's object: it writes the job last
        if job.done or job.status == "cancelling":
            return job
        job.mark("cancelling" if running else "cancelled")
        self.store.save_job(job)
        if running:
            self._cancelled.add(job.id)
            self._running[1].cancel()
        return job

    async def _serve(self) -> None:
        while True:
            job_id = await self._queue.get()
            job = self.store.get_job(job_id, None)
            if job is None or job.status not in RESUMABLE:
                continue  # cancelled while queued
            task = asyncio.create_task(self._run(job))
            self._running = (job, task)
            try:
                await asyncio.shield(task)  # stop() cancels this wait, and the job with it below
            except asyncio.CancelledError:
                if job.id not in self._cancelled:  # the server drains: leave the job resumable
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    raise
                if job.status == "cancelling":  # cancelled before any line ran (still waiting for the model)
                    job.mark("cancelled")
                    self.store.save_job(job)
            except Exception:  # noqa: BLE001 - a bug in one job must not stop the queue; the log has it
                log.exception("batch %s failed", job.id)
                job.mark("failed")
                job.errors = [{"code": "internal_error", "message": "the job failed; see the server log"}]
                self.store.save_job(job)
            finally:
                self._running = None
                self._cancelled.discard(job.id)

    async def _run(self, job: BatchJob) -> None:
        st = self.state
        while not st.ready:  # the model is still loading (or a restart resumed this job early)
            await asyncio.sleep(0.25)
        try:
            lines = await asyncio.to_thread(read_input, self.store.content_path(job.input_file_id), job.endpoint)
        except (OSError, DuplicateCustomId) as e:
            job.errors = [{"code": "duplicate_custom_id" if isinstance(e, DuplicateCustomId) else "invalid_file",
                           "message": str(e)[:400], "param": None, "line": None}]
            job.mark("failed")
            self.store.save_job(job)
            return
        out, err = ResultsFile(self.store.content_path(job.output_id)), ResultsFile(self.store.content_path(job.error_id))
        job.request_counts = {"total": len(lines), "completed": out.counts["completed"] + err.counts["completed"],
                              "failed": out.counts["failed"] + err.counts["failed"]}
        if job.status != "in_progress":
            job.mark("in_progress")
        self.store.save_job(job)
        try:
            await self._run_lines(job, pending_lines(lines, out.done | err.done), out, err)
        except asyncio.CancelledError:
            if job.id in self._cancelled:
                self._finish(job, out, err, "cancelled")
            raise
        finally:
            out.close()
            err.close()
        job.mark("finalizing")
        self._finish(job, out, err, "completed")

    async def _run_lines(self, job: BatchJob, todo: list, out: ResultsFile, err: ResultsFile) -> None:
        from lmserve.server.batch.lines import run_lines

        st, saved = self.state, time.monotonic()
        window = st.max_num_seqs()  # a full batch; interactive requests still queue first
        async for r in run_lines(st, todo, job.owner, window, retry=_busy):
            if st.draining:  # a result cut short by the drain is not a result: the line runs again after restart
                return
            (out if succeeded(r.result) else err).append(r.result)
            job.request_counts["completed" if succeeded(r.result) else "failed"] += 1
            if time.monotonic() - saved > SAVE_EVERY_S:
                self.store.save_job(job)
                saved = time.monotonic()

    def _finish(self, job: BatchJob, out: ResultsFile, err: ResultsFile, status: str) -> None:
        """Publish the results files that hold lines (their file objects), then the job's final status."""
        for results, attr, suffix in ((out, "output_file_id", "output"), (err, "error_file_id", "errors")):
            if results.path.exists() and results.path.stat().st_size:
                file_id = results.path.stem
                self.store.save_file(StoredFile(file_id, results.path.stat().st_size, int(time.time()),
                                                f"{job.id}_{suffix}.jsonl", "batch_output", job.owner))
                setattr(job, attr, file_id)
        job.mark(status)
        self.store.save_job(job)
        log.info("batch %s %s: %s", job.id, status, job.request_counts)


def _busy(r: LineResult) -> bool:
    """A line refused only because the server is busy (queue full, the key's rate limit): try it again later."""
    response = r.result.get("response") or {}
    code = ((response.get("body") or {}).get("error") or {}).get("code")
    return response.get("status_code") in (429, 503) and code != "engine_dead"
