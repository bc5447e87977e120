"""A tensor-parallel or pipeline worker rank (ranks 1..N-1), one process each; rank 0 lives in the engine's process.
A pipeline rank loads only its layers and its forward receives from the rank before it and sends to the next.

The worker joins the process group, loads only its shard, builds its KV cache (its KV heads only) once
rank 0 sends the pool size, says "ready", then runs one forward per SchedulerOutput it receives over its
pipe: the same forward as rank 0, whose all-reduces pair with rank 0's. It keeps the same persistent rows
as rank 0 (token ids and block tables, updated by the same diffs) and never samples.

It dies with its parent: the pipe's EOF (the parent closed it or died) ends the loop, and a watcher
thread exits the process once its parent process is gone even while a collective blocks. It ignores
SIGINT (a Ctrl-C reaches the whole process group; the parent drains first, then closes the pipe).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch

from lmserve.config import EngineConfig
from lmserve.layers.attention.backends import resolve_attention_backend
from lmserve.layers.formats.pipeline import PPStage
from lmserve.loader import load_model, read_model_config, resolve_model_path
from lmserve.loader.sharding import TPShard
from lmserve.utils import resolve_kv_dtype
from lmserve.worker.model_runner import ModelRunner
from lmserve.worker.transforms import TransformContext, apply_transforms

log = logging.getLogger(__name__)

PARENT_POLL_S = 0.5  # how often a worker checks that its parent still lives
# Every rank runs on this host. Unpinned, gloo's pair listeners and NCCL's bootstrap sockets bind to the address the
# hostname resolves to (or any interface NCCL likes), which may face the network; an operator's setting is overridden.
LOOPBACK_IFNAME = "lo0" if sys.platform == "darwin" else "lo"
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": LOOPBACK_IFNAME, "NCCL_SOCKET_IFNAME": "=" + LOOPBACK_IFNAME}  # "=": exact name


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to join the group (plain data: it crosses a process start)."""

    rank: int
    world_size: int
    init_method: str  # file://<private dir>/store: the rendezvous (executor.RankProcesses), no socket
    timeout_s: float
    num_threads: int
    parent_pid: int


def device_for(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank on CUDA; every rank on the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_group(spec: RankSpec, device: torch.device) -> None:
    """Join the default process group (gloo on CPU, NCCL on CUDA), its sockets on loopback only."""
    import torch.distributed as dist

    os.environ.update(LOOPBACK_ENV)  # read by gloo's device and NCCL's bootstrap when the group forms, below
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.timeout_s))


def worker_main(spec: RankSpec, cfg: EngineConfig, dtype: torch.dtype, device: torch.device, conn) -> None:
    """Entry point of a worker process (multiprocessing spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {spec.rank} %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(spec.parent_pid,), name="lmserve-parent-watch",
                     daemon=True).start()
    torch.set_num_threads(spec.num_threads)
    device = device_for(device, spec.rank)
    init_group(spec, device)
    tp, pp = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    # a pipeline rank holds only its stage's layers (the loader cuts the model), a tensor-parallel rank its shard of
    # each; with both, global rank = stage * tp + tensor rank
    stage = PPStage(spec.rank // tp, pp, read_model_config(resolve_model_path(cfg.model, cfg.revision)).num_layers,
                    spec.rank % tp, tp, cfg.parallel.micro_batches_on(device.type)) if pp > 1 else None
    shard = TPShard(spec.rank % tp, tp) if tp > 1 else None
    loaded = load_model(cfg.model, dtype, device, quantization=cfg.quantization, revision=cfg.revision,
                        shard=shard, max_model_len=cfg.max_model_len, stage=stage,
                        encoder_dtype=cfg.mm_encoder_dtype)
    kv_dtype = resolve_kv_dtype(cfg.cache.kv_cache_dtype, dtype, loaded.keeps_blocks, device)
    backend = resolve_attention_backend(cfg.attention_backend, device, dtype).name  # as rank 0 resolved it
    # the same pipeline as rank 0's (engine/build.py; LoRA is refused with tensor parallelism), while rank 0 sizes
    done = apply_transforms(TransformContext(loaded, device, dtype, triton=backend == "triton", kv_dtype=kv_dtype))
    num_blocks, block_size, kv_groups = conn.recv()
    runner = ModelRunner(loaded.model, loaded.model.config, num_blocks, block_size, dtype, device, done,
                         kv_dtype=kv_dtype, attention_backend=backend, samples=False, kv_groups=kv_groups)
    conn.send("ready")
    _serve(runner, conn)


def _serve(runner: ModelRunner, conn) -> None:
    """One forward per SchedulerOutput; None (or the pipe closing) ends the worker."""
    import torch.distributed as dist

    while True:
        try:
            out = conn.recv()
        except (EOFError, OSError):
            break
        if out is None:
            break
        runner.forward_only(out)
    dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    """Exit at once when the parent is gone (re-parented), even if the main thread is inside a collective."""
    while os.getppid() == parent_pid:
        threading.Event().wait(PARENT_POLL_S)
    os._exit(1)
