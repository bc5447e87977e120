"""One host-to-device copy per step: every numpy array inside a step's input dataclasses travels together.

The input builders work in numpy (cheap, vectorised, no device round trips) and leave numpy arrays in
their dataclasses. `to_device` swaps each array for a tensor: on CPU a zero-copy view, on CUDA a view
into one pinned staging buffer that is copied with a single non-blocking transfer, so the copy queues
behind the running forward instead of making ~10 small synchronous ones. The pinned buffer is kept
across steps (`PinnedStaging`): pinning fresh memory every step costs more than the copy itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import torch

_ALIGN = 8  # bytes: every array starts at an offset that any element type can be viewed at

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}


class PinnedStaging:
    """A pinned host buffer reused by every step's upload; grows by doubling, never shrinks."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 view of at least nbytes, safe to overwrite: the previous step's copy out of it has finished."""
        if self._copied is not None:
            self._copied.synchronize()  # normally long done: the step downloaded its sampled ids since
        if self._buf is None or self._buf.numel() < nbytes:
            size = max(nbytes, 2 * self._buf.numel() if self._buf is not None else 1 << 16)
            self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return self._buf.numpy()[:nbytes]

    def send(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The first nbytes on `device`: one non-blocking copy, recorded so the next `take` waits for it."""
        out = self._buf[:nbytes].to(device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out


def to_device(tree: Any, device: torch.device, staging: PinnedStaging | None = None) -> Any:
    """A copy of `tree` (dataclasses, lists, tuples, dicts) with every numpy array replaced by a tensor.

    On CUDA the arrays travel in one copy through `staging` (a fresh pinned buffer when none is given)."""
    if torch.device(device).type != "cuda":  # each array becomes a tensor sharing its memory: one walk, no copy
        return _walk(tree, _as_tensor)
    arrays: list[np.ndarray] = []
    _walk(tree, lambda a: arrays.append(a) or a)
    if not arrays:
        return tree
    tensors = iter(_upload(arrays, torch.device(device), staging))
    return _walk(tree, lambda a: next(tensors))


def _walk(node: Any, fn: Callable[[np.ndarray], Any]) -> Any:
    """Rebuild `node` with fn applied to each numpy array, depth first in field order."""
    if isinstance(node, np.ndarray):
        return fn(node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {f.name: _walk(getattr(node, f.name), fn) for f in dataclasses.fields(node) if f.init}
        return dataclasses.replace(node, **changes)
    if isinstance(node, (list, tuple)):
        return type(node)(_walk(x, fn) for x in node)
    if isinstance(node, dict):
        return {k: _walk(v, fn) for k, v in node.items()}
    return node


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _upload(arrays: list[np.ndarray], device: torch.device, staging: PinnedStaging | None) -> list[torch.Tensor]:
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    total = max(total, _ALIGN)
    staging = staging or PinnedStaging()
    host = staging.take(total)
    for a, off in zip(arrays, offsets):
        host[off:off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    buf = staging.send(total, device)  # the one copy
    return [buf[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)]
