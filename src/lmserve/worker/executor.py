"""Executors: what the engine hands each step's SchedulerOutput to.

Pipeline parallelism runs through the same MultiprocExecutor: each worker gets the step over its pipe, and rank 0's
forward sends its hidden states round the ring of ranks and gets the last rank's back (layers/formats/pipeline.py),
so a dead or hung pipeline rank fails the step (and the engine) exactly as a tensor-parallel one does.

`UniProcExecutor` runs the one ModelRunner in this process (no tensor parallelism). `MultiprocExecutor`
runs rank 0's runner here and ranks 1..N-1 in child processes (worker/tp_worker.py): each step it
pickles the plain-data SchedulerOutput down every worker's pipe, then runs rank 0's forward, whose
all-reduces meet the workers'; rank 0 alone runs the LM head and samples, so only it returns tokens.

A rank that dies or hangs is fatal: a watcher thread sees a worker process exit at once (even when the
engine is idle) and calls `on_fatal`; a step whose collective fails or times out (a hung rank:
ParallelConfig.rank_timeout_s) raises ExecutorDeadError. Either way the other workers are stopped.

The ranks meet through a FileStore in a private directory (mkdtemp: 0700), not a TCPStore: a TCPStore's
server listens on every interface whatever host its URL names, with no authentication, so any host that
reaches this one could read and write its keys. No socket is opened for the rendezvous; gloo's and NCCL's
own sockets are pinned to loopback (tp_worker.init_group). The directory goes when the ranks are stopped.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
from multiprocessing.connection import wait
from typing import Callable

import torch

from lmserve.config import EngineConfig
from lmserve.sched.output import SchedulerOutput
from lmserve.worker.model_runner import ModelRunner, RunnerOutput
from lmserve.worker.tp_worker import RankSpec, init_group, worker_main

log = logging.getLogger(__name__)

STOP_GRACE_S = 2.0  # a worker asked to stop that has not exited by then is killed (an idle one exits in ms)


class ExecutorDeadError(BaseException):
    """A tensor-parallel rank died or hung: no step can run again (a BaseException: the engine thread ends)."""


class UniProcExecutor:
    """Today's behaviour: the one runner, in this process."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.on_fatal: Callable[[BaseException], None] | None = None  # never called: nothing can die apart

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the step (looked up at call time, so a wrapped runner.execute is honoured)."""
        return self.runner.execute(out)

    def shutdown(self) -> None:
        """Nothing to stop."""


class RankProcesses:
    """Worker ranks 1..N-1, started before rank 0 loads (they load their shards meanwhile)."""

    def __init__(self, cfg: EngineConfig, dtype: torch.dtype, device: torch.device, num_threads: int) -> None:
        world = cfg.parallel.world_size  # tensor or pipeline ranks (not both yet: preflight)
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch threads or locks
        self.store_dir = tempfile.mkdtemp(prefix="lmserve-tp-")  # 0700: only this user can open the store
        init_method = f"file://{self.store_dir}/store"
        self.procs, self.conns = [], []
        self._stop_lock = threading.Lock()
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            spec = RankSpec(rank, world, init_method, cfg.parallel.rank_timeout_s, num_threads, os.getpid())
            proc = ctx.Process(target=worker_main, args=(spec, cfg, dtype, device, child),
                               name=f"lmserve-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()  # only the worker holds its end: its death is our EOF
            log.info("tensor-parallel rank %d started (pid %d)", rank, proc.pid)
            self.procs.append(proc)
            self.conns.append(parent)
        try:
            init_group(RankSpec(0, world, init_method, cfg.parallel.rank_timeout_s, num_threads, os.getppid()), device)
        except BaseException:  # a rank that never joined: stop the others rather than leave them waiting
            self.stop()
            raise

    def send_pool(self, num_blocks: int, block_size: int, kv_groups: list[tuple[int, ...]], timeout_s: float) -> None:
        """Give every worker the KV pool size and its groups' layers, and wait until each has built its cache."""
        for conn in self.conns:
            conn.send((num_blocks, block_size, kv_groups))
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if not conn.poll(timeout_s) or conn.recv() != "ready":
                raise ExecutorDeadError(f"tensor-parallel rank {rank} did not start "
                                        f"(exit code {proc.exitcode}; its log lines say why)")

    def stop(self) -> None:
        """Ask each worker to stop, then kill the ones that do not (one caller at a time: the failure watcher and
        the engine's shutdown may both get here, and two threads reaping one child would confuse its state)."""
        with self._stop_lock:
            for conn in self.conns:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            for proc in self.procs:
                proc.join(STOP_GRACE_S)
                if proc.exitcode is None:  # hung (or stopped): SIGKILL works on a stopped process too
                    proc.kill()
                    proc.join(STOP_GRACE_S)
            for conn in self.conns:
                conn.close()
            # Every worker is gone (rank 0's store, if still held, tolerates a missing file when it is freed)
            shutil.rmtree(self.store_dir, ignore_errors=True)


class MultiprocExecutor:
    """Rank 0 here, the other ranks in their own processes; one scheduler, one sampler (rank 0's)."""

    def __init__(self, runner: ModelRunner, ranks: RankProcesses) -> None:
        self.runner, self.ranks = runner, ranks
        self.on_fatal: Callable[[BaseException], None] | None = None  # the engine's death (AsyncEngine sets it)
        self.error: ExecutorDeadError | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._between_steps = threading.Event()  # clear while rank 0 is inside a step (maybe inside a collective)
        self._between_steps.set()
        threading.Thread(target=self._watch, name="lmserve-tp-watch", daemon=True).start()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Send the step to every worker, run rank 0's part, return rank 0's sampled tokens."""
        if self.error is not None:
            raise self.error
        self._between_steps.clear()
        try:
            for conn in self.ranks.conns:
                conn.send(out)
            return self.runner.execute(out)
        except (BrokenPipeError, OSError, RuntimeError) as e:  # a worker gone, or gloo/NCCL: a peer closed or timed out
            raise self._fail(f"a tensor-parallel step failed: {type(e).__name__}: {e}") from e
        finally:
            self._between_steps.set()

    def shutdown(self) -> None:
        """Stop every worker (the engine is closing), then leave the process group."""
        import torch.distributed as dist

        self._stopping.set()
        self.ranks.stop()
        # A step stuck in a collective (a hung rank, now killed) fails within moments of its peer's socket closing;
        # exiting while it is still inside gloo would abort the process (std::terminate) instead of exiting cleanly.
        if self._between_steps.wait(STOP_GRACE_S * 2) and dist.is_initialized():
            dist.destroy_process_group()  # a later engine in this process may form a new group

    def _watch(self) -> None:
        """Wait for any worker process to end; one that ends while we are not stopping kills the engine."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.ranks.procs, start=1)}
        while not self._stopping.is_set():
            done = wait(list(sentinels), timeout=1.0)
            if done and not self._stopping.is_set():
                rank = sentinels[done[0]]
                proc = self.ranks.procs[rank - 1]
                proc.join(1.0)  # reap it: its exit code (a negative signal number when killed) names the cause
                code = proc.exitcode
                error = self._fail(f"tensor-parallel rank {rank} exited (exit code {code})")
                if self.on_fatal is not None:
                    self.on_fatal(error)
                return

    def _fail(self, message: str) -> ExecutorDeadError:
        """Record the first failure and stop the other ranks (none may outlive a broken group)."""
        with self._lock:
            if self.error is None:
                log.critical("%s; stopping every rank", message)
                self.error = ExecutorDeadError(message)
                self._stopping.set()
                threading.Thread(target=self.ranks.stop, name="lmserve-tp-stop", daemon=True).start()
        return self.error
