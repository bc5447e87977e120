"""Which implementation attends over the paged KV cache (`--attention-backend auto|triton|reference`).

- reference: `PagedAttention` (layers/attention/paged.py): on CPU the native C++ kernel reading K/V in place,
  elsewhere gather + SDPA. The plain path every other backend is tested against.
- triton: `TritonPagedAttention` (layers/kernels/triton/backend.py): split-K paged decode and paged prefill kernels
  that read K/V in place through the block tables. It needs CUDA, or on CPU Triton's interpreter
  (TRITON_INTERPRET=1), which is how the tests run it on a machine without a GPU.
- auto: triton on a CUDA GPU where Triton runs (installed, compute capability 8.0+ for bfloat16, else 7.0+),
  else reference; the CPU keeps its native kernel.

The runner builds one context per forward from `attention_factory(name)(kv_caches, metadata)`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from lmserve.errors import ConfigError
from lmserve.layers.attention.context import AttentionContext
from lmserve.layers.attention.paged import PagedAttention, PagedAttentionMetadata
from lmserve.layers.kernels.triton import interpreting, triton_importable

ATTENTION_BACKENDS = ("auto", "triton", "reference")

AttentionFactory = Callable[[list[torch.Tensor], PagedAttentionMetadata], AttentionContext]


class BackendChoice(NamedTuple):
    """The backend that runs and why (for the start-up log)."""

    name: str  # triton | reference
    why: str


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> BackendChoice:
    """--attention-backend -> the backend that runs; ConfigError where `triton` was asked for and cannot run."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if name == "reference":
        return BackendChoice("reference", "--attention-backend reference")
    if name == "auto" and device.type != "cuda":
        return BackendChoice("reference", f"auto: the Triton kernels are for CUDA, this is {device.type}")
    why_not = triton_unsupported(device, dtype)
    if name == "triton":
        if why_not:
            raise ConfigError(f"--attention-backend triton: {why_not}")
        return BackendChoice("triton", "--attention-backend triton" + (", Triton's interpreter" if device.type == "cpu"
                                                                       else ""))
    return BackendChoice("reference", f"auto: {why_not}") if why_not else BackendChoice("triton", "auto: CUDA")


def triton_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the Triton kernels cannot run on this device and dtype, or None when they can."""
    if not triton_importable():
        return "Triton is not installed (pip install 'lmserve[gpu]')"
    if device.type == "cpu":
        return None if interpreting() else "its kernels need a CUDA GPU (on CPU only under TRITON_INTERPRET=1, for tests)"
    if device.type != "cuda":
        return f"its kernels need a CUDA GPU, not {device.type}"
    need = (8, 0) if dtype == torch.bfloat16 else (7, 0)
    have = torch.cuda.get_device_capability(device)
    if have < need:
        return f"compute capability {have[0]}.{have[1]} is below the {need[0]}.{need[1]} its kernels need for {dtype}"
    return None


def _triton() -> AttentionFactory:
    from lmserve.layers.kernels.triton.backend import TritonPagedAttention  # imports triton: only when chosen

    return TritonPagedAttention


_FACTORIES: dict[str, Callable[[], AttentionFactory]] = {"reference": lambda: PagedAttention, "triton": _triton}


def attention_factory(name: str) -> AttentionFactory:
    """The AttentionContext class of a resolved backend name (triton | reference)."""
    return _FACTORIES[name]()
