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
the process a check is one atomic load. `gate_stats()` counts the process's holds and pauses; each runner counts its
own (`num_holds`, `paused_s`: the server's lmserve:cpu_gate_* metrics, per model).
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
    """One runner's side of the gate: an encoder's holds it for its short steps, a generative model's pauses."""

    def __init__(self, model: nn.Module, encoder: bool, device: torch.device) -> None:
        mod = native_module() if device.type == "cpu" else None
        self._mod = mod
        self.holds = mod is not None and encoder
        self.pauses = mod is not None and not encoder
        self.num_holds = 0  # this runner's steps that held the gate
        self.paused_s = 0.0  # what this runner's steps waited for others' holds
        if self.pauses and "cpu_gate_hooks" not in model.__dict__:  # engines sharing a loaded model hook it once
            model.__dict__["cpu_gate_hooks"] = [layer.register_forward_pre_hook(self._pause)
                                                for layer in decoder_layers(model)]

    @contextlib.contextmanager
    def step(self, num_tokens: int) -> Iterator[None]:
        """Around one step's forward: hold the gate (a short encoder step), or start a pausing step."""
        if self.holds and num_tokens <= URGENT_TOKENS:
            self.num_holds += 1
            self._mod.gate_hold()
            try:
                yield
            finally:
                self._mod.gate_release()
        elif self.pauses:
            self._mod.gate_begin_step(PAUSE_PER_STEP_MS * 1000)
            try:
                yield
            finally:
                self.paused_s += self._mod.gate_step_waited() / 1e6
        else:
            yield

    def pause(self) -> None:
        """A generative step's point between layers outside the layer loop (before the LM head)."""
        if self.pauses:
            self._mod.gate_pause()

    def _pause(self, module: nn.Module, args: object) -> None:
        self._mod.gate_pause()
