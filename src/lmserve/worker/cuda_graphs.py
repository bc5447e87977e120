"""Decode steps replayed from CUDA graphs: fixed-shape inputs per batch-size bucket.

A CUDA graph replays recorded kernels with the addresses and shapes they had at capture, so a captured
decode step reads its inputs from static buffers (token ids, positions, slot mapping, block tables,
context lengths) that every step overwrites in place, and its attention metadata has no host-side
values that change between steps (the decode mask is derived from the context lengths on the device).
A step of n decode-group tokens runs in the smallest bucket >= n; rows n.. are padding that write
their K/V into a scratch slot the block pool never hands out and read one key from it.
Prefill and mixed steps run eagerly, as do steps larger than the largest bucket.

On CPU there is nothing to capture: `DecodeGraphs(capture=False)` runs the same fixed-shape forward
eagerly, which is how the padding and the static metadata are tested without a GPU
(tests/test_cuda_graphs.py); the capture itself is covered by tests/test_cuda.py on a CUDA machine.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from lmserve.layers.attention.backends import AttentionFactory
from lmserve.layers.attention.paged import PagedAttention, PagedAttentionMetadata
from lmserve.worker.inputs import StepInputs

log = logging.getLogger("lmserve")

_FIELDS = ("input_ids", "positions", "slot_mapping", "context_lens")  # one int64 per row each


def decode_buckets(max_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, 8, ... up to the first power of two >= max_tokens, capped at max_tokens."""
    sizes, b = [], 1
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    sizes.append(max_tokens)
    return tuple(sizes)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds n rows, or None when n is larger than every bucket."""
    for b in buckets:
        if b >= n:
            return b
    return None


@dataclass(frozen=True)
class ScratchSlot:
    """Where padding rows write and read: the extra block at the end of every layer's KV cache."""

    block: int
    block_size: int

    @property
    def slot(self) -> int:
        return self.block * self.block_size


class StaticDecodeInputs:
    """The buffers a captured decode step reads, and their host mirror (pinned on CUDA).

    Layout: one int64 buffer [4 + max_blocks, max_rows] holding input_ids, positions, slot_mapping,
    context_lens, then the block tables transposed, so a step is one host fill and one device copy.
    """

    def __init__(self, max_rows: int, max_blocks: int, scratch: ScratchSlot, device: torch.device) -> None:
        self.max_rows, self.max_blocks, self.scratch = max_rows, max_blocks, scratch
        shape = (len(_FIELDS) + max_blocks, max_rows)
        self.host = torch.zeros(shape, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.device_buf = self.host.to(device) if device.type != "cpu" else self.host
        self._np = self.host.numpy()
        self.clear(0, max_rows)

    def clear(self, start: int, end: int) -> None:
        """Make rows [start, end) padding: token 0 at position 0, writing to and reading only the scratch slot."""
        h = self._np
        h[0:2, start:end] = 0
        h[2, start:end] = self.scratch.slot
        h[3, start:end] = 1
        h[4:, start:end] = self.scratch.block

    def fill(self, inputs: StepInputs, bucket: int) -> None:
        """Copy a decode-only step (numpy) into the first rows, pad up to `bucket`, upload once."""
        a = inputs.attn
        n = len(inputs.input_ids)
        h = self._np
        h[0, :n] = inputs.input_ids
        h[1, :n] = inputs.positions
        h[2, :n] = a.slot_mapping
        h[3, :n] = a.decode_context_lens
        width = a.decode_block_tables.shape[1]
        h[4:4 + width, :n] = a.decode_block_tables.T
        h[4 + width:, :n] = self.scratch.block  # never read (beyond the context), kept valid
        self.clear(n, bucket)
        self.upload()

    def upload(self) -> None:
        """One copy of the whole buffer (pinned, non-blocking: it queues behind the previous step's work)."""
        if self.device_buf is not self.host:
            self.device_buf.copy_(self.host, non_blocking=True)

    def views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        """(input_ids, positions, attention metadata) over the first `rows` rows of the device buffer."""
        d = self.device_buf
        meta = PagedAttentionMetadata(
            slot_mapping=d[2, :rows], num_decodes=rows,
            decode_block_tables=d[4:, :rows].t(),  # [rows, max_blocks]: a strided view, no copy
            decode_mask=None,  # derived from the context lengths on the device (fixed shape)
            prefills=[], decode_context_lens=d[3, :rows])
        return d[0, :rows], d[1, :rows], meta


class DecodeGraphs:
    """Runs decode-only steps at fixed shapes: captured CUDA graphs per bucket, or eagerly with capture=False."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], scratch: ScratchSlot,
                 max_rows: int, max_blocks: int, capture: bool, attention: AttentionFactory = PagedAttention) -> None:
        self.model, self.kv_caches, self.attention = model, kv_caches, attention
        self.buckets = decode_buckets(max_rows)
        device = kv_caches[0].device
        self.inputs = StaticDecodeInputs(max_rows, max_blocks, scratch, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        if capture:
            self._capture_all()

    def fits(self, inputs: StepInputs, num_prefill_tokens: int) -> bool:
        """A decode-only step (plain decodes or verify runs) of at most the largest bucket's rows."""
        n = len(inputs.input_ids)
        return (num_prefill_tokens == 0 and len(inputs.prompt_lp_indices) == 0 and n <= self.buckets[-1]
                and inputs.attn.decode_block_tables.shape[1] <= self.inputs.max_blocks)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """hidden [n, hidden_size] for a step that `fits`: its rows of the bucket's output."""
        n = len(inputs.input_ids)
        bucket = bucket_for(n, self.buckets)
        self.inputs.fill(inputs, bucket)
        if bucket in self.graphs:
            graph, out = self.graphs[bucket]
            graph.replay()
            return out[:n]
        return self._forward(bucket)[:n]

    def _forward(self, rows: int) -> torch.Tensor:
        ids, pos, meta = self.inputs.views(rows)
        return self.model(ids, pos, self.attention(self.kv_caches, meta))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every bucket, largest first so that smaller graphs reuse the first one's memory pool."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for rows in reversed(self.buckets):
            self.inputs.clear(0, self.inputs.max_rows)
            self.inputs.upload()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits, cuBLAS workspaces
                for _ in range(2):
                    self._forward(rows)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(rows)
            self.graphs[rows] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        log.info("CUDA graphs: captured %d decode batch sizes (%s) in %.1f s", len(self.buckets),
                 ", ".join(map(str, self.buckets)), self.capture_seconds)


def sampling_rows_only(inputs: StepInputs) -> StepInputs:
    """A graph step's inputs less what its forward reads from the static buffers: only the rows that reach
    the LM head still travel with the step's one upload."""
    empty = np.zeros(0, dtype=np.int64)
    return dataclasses.replace(inputs, input_ids=empty, positions=empty, attn=None)
