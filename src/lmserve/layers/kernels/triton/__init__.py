"""Triton kernels for the CUDA path, each beside a plain torch reference (`reference.py`).

- `decode.py`: paged decode attention reading K/V in place through the block table, split-K (flash-decoding)
- `prefill.py`: prefill / extend attention over block tables (causal, after a cached prefix)
- `rope_kv.py`: rotary embedding of q/k fused with the write of the new K/V into the paged cache
- `moe.py`: a fused MoE expert layer (tokens sorted by expert on the device, grouped GEMM)
- `backend.py`: `TritonPagedAttention`, the AttentionContext the CUDA runner uses (`--attention-backend`)

With TRITON_INTERPRET=1 in the environment before these modules are imported, `triton.jit` builds each
kernel for Triton's interpreter, which runs it on CPU tensors through numpy: that is how CI tests them
(tests/conftest.py sets it on a machine without CUDA). Triton reads the switch when a kernel is decorated,
so a module imported before the switch was set keeps compiled kernels that need a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def interpreting() -> bool:
    """Whether these kernels run under Triton's interpreter (CPU tensors through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_importable() -> bool:
    """Triton is installed (it is an optional dependency: the `gpu` and `test` extras). Found, not imported:
    importing triton costs ~150 MiB of RSS, which a CPU server that never runs a Triton kernel must not pay
    (tests/test_load_memory.py)."""
    return importlib.util.find_spec("triton") is not None


def dot_flags(dtype: torch.dtype) -> dict:
    """How the kernels multiply: float32 inputs in full float32 (not TF32, which would cost ~1e-3 of accuracy);
    half-precision inputs on tensor cores, accumulating in float32. The interpreter's tl.dot reads bfloat16
    operands' raw bits (triton 3.9), so under it every operand is widened to float32 first."""
    return {"UPCAST": interpreting() or dtype == torch.float32,
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}
