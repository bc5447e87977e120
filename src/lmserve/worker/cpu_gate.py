"""Two models on one CPU: an encoder's short step goes first, and a generative model's step pauses for it.

A retrieval stack serves an embedder beside its chat model, and the embedding of a user's query is on that user's
critical path. Sharing the cores with the chat model's decode steps made one sentence's embedding ~1.4-2x slower
than alone (a 2-core Zen 1: 17 -> 34 ms; benchmarks/results/retrieval_mixed_zen1.md). So, on a CPU:

- an encoder's step of at most URGENT_TOKENS tokens holds the process's gate (layers/kernels/csrc/cpu_gate.h) from
  its inputs to its pooled outputs; longer encoder steps (bulk indexing, a large rerank) share the cores as before;
- a generative model's step pauses while the gate is held: at its start, at every decoder layer of the module loop
  (a forward pre-hook, as worker/progress.py counts them) and of the native decode stack (in C++), and before its
  LM head. It waits at most PAUSE_PER_STEP_MS in all per step, so a stream of embeddings slows decoding by at most
  that much a step but never stops it. A paused step computes exactly what it would have.

Nothing is held or paused on CUDA (the GPU is not the CPU's cores) or without the native kernels; with no encoder in
the process a check is one atomic load in C++ (in the module loop, a hook's call a layer). `gate_stats()` counts the
process's holds and pauses; each runner counts its own (`num_holds`, `paused_s`: the lmserve:cpu_gate_* metrics).

Only encoders hold it: a decoder serving embeddings (a last-token embedder, a yes/no reranker) is a generative
model here, and pauses. Only this process's steps pause: tensor- and pipeline-parallel ranks in other processes do
not (rank 0's pause holds them at its next collective).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from lmserve.layers.kernels.native import native_module
from lmserve.worker.progress import decoder_layers

URGENT_TOKENS = 512  # an encoder step of at most this many tokens holds the gate: a query or a few sentences
PAUSE_PER_STEP_MS = 50  # what one generative step may wait for encoder steps, in all (~2 sentences on a slow CPU)


def gate_stats() -> dict[str, int]:
    """Holds, pauses and microseconds paused since the process started; zeros without the native kernels."""
    mod = native_module()
    return dict(mod.gate_stats()) if mod is not None else {"holds": 0, "pauses": 0, "paused_us": 0}


class CpuGate:
    """One runner's side of the gate: an encoder's holds it for its short steps, a generative model's pauses.

    A generative engine brackets each of its steps with `begin_step` / `end_step` (engine/llm_engine.py), so the
    allowance is the engine step's, its draft model's steps included; the runner's `step` and `pause` wait within it.
    """

    def __init__(self, model: nn.Module, encoder: bool, device: torch.device) -> None:
        mod = native_module() if device.type == "cpu" else None
        self._mod = mod
        self.holder = mod is not None and encoder
        self.pauser = mod is not None and not encoder
        self.num_holds = 0  # this runner's steps that held the gate
        self.paused_s = 0.0  # what this engine's steps waited for others' holds (end_step adds them)
        if self.pauser and "cpu_gate_hooks" not in model.__dict__:  # engines sharing a loaded model hook it once
            model.__dict__["cpu_gate_hooks"] = [layer.register_forward_pre_hook(self._pause)
                                                for layer in decoder_layers(model)]

    def begin_step(self) -> None:
        """An engine step begins on this thread: it may wait PAUSE_PER_STEP_MS in all, and waits now if held."""
        if self.pauser:
            self._mod.gate_begin_step(PAUSE_PER_STEP_MS * 1000)

    def end_step(self) -> float:
        """The engine step has ended (no waiting until the next): the seconds it waited."""
        if not self.pauser:
            return 0.0
        waited = self._mod.gate_end_step() / 1e6
        self.paused_s += waited
        return waited

    @contextlib.contextmanager
    def step(self, num_tokens: int) -> Iterator[None]:
        """Around one runner step: hold the gate (an encoder's step of at most URGENT_TOKENS), or wait if it is held."""
        if self.holder and num_tokens <= URGENT_TOKENS:
            self.num_holds += 1
            self._mod.gate_hold()
            try:
                yield
            finally:
                self._mod.gate_release()
            return
        self.pause()
        yield

    def pause(self) -> None:
        """A generative step's point between layers outside the layer loop (the runner's start, its LM head)."""
        if self.pauser:
            self._mod.gate_pause()

    def _pause(self, module: nn.Module, args: object) -> None:
        self._mod.gate_pause()
