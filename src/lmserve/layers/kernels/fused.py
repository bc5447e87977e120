"""Row-wise ops of a decoder layer: one fused native call each on CPU float32, PyTorch elsewhere.

The PyTorch functions here are the reference; `layers/kernels/csrc/fused_ops.cpp` computes the same per row
in one pass (tests/test_native_ops.py compares them). Both paths compute every row alone, so a row's
result never depends on the rest of the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmserve.layers.blocks.rotary import apply_rotary
from lmserve.layers.kernels.native import native_module


def _native(x: torch.Tensor):
    """The native module when `x` can use it (CPU float32), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return native_module()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in float32, then scale (in the weight's dtype for half models)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); with no residual, (norm(x), x).

    The residual sum is the decoder's running hidden state. The native path adds into `residual` in
    place (one pass for the add and the norm), so callers pass a residual they own.
    """
    mod = _native(x)
    if residual is None:
        return (mod.rms_norm(x, weight, eps) if mod is not None else rms_norm_ref(x, weight, eps)), x
    if mod is not None and residual.is_contiguous():
        return mod.add_rms_norm_(x, residual, weight, eps), residual
    residual = residual + x
    return rms_norm_ref(residual, weight, eps), residual


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension (F.layer_norm, the reference). On CPU float32 one native call over the rows
    in lmserve's thread pool: ATen's opens an OpenMP region for every call, and an encoder's step for one short
    sentence makes 13, each waking the other core's sleeping thread (~250 us a call for 18 rows of all-MiniLM-L6-v2
    on a 2-vCPU Zen 1 VM, 3.2 of its ~27 ms served); the native call keeps a few rows on the caller's thread."""
    mod = _native(x)
    if mod is not None and all(p is None or _native(p) is not None for p in (weight, bias)):
        return mod.layer_norm(x, weight, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] = [gate | up] -> silu(gate) * up, [T, I]."""
    mod = _native(gate_up)
    if mod is not None:
        return mod.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] = [gate | up] -> gelu_tanh(gate) * up, [T, I] (GeGLU: Gemma's MLP)."""
    mod = _native(gate_up)
    if mod is not None:  # one pass: ATen's gelu and the multiply were ~8% of a Gemma 3 prefill
        return mod.gelu_tanh_and_mul(gate_up)
    return gelu_tanh_and_mul_ref(gate_up)


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The PyTorch reference of gelu_tanh_and_mul."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0  # every published gpt-oss config's swiglu_alpha, swiglu_limit


def swiglu_oai_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] = [gate | up] -> (up + 1) * gate * sigmoid(1.702 * gate), gate clamped above at 7 and up to
    [-7, 7], [T, I] (gpt-oss's experts, as transformers' GptOssExperts: its gate/up columns interleave, ours are
    halves, split at load)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


ACT_AND_MUL = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul, "swiglu_oai": swiglu_oai_and_mul}


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by per-token angles; the native path rotates in place and returns x.

    cos/sin narrower than D rotate only the first dims of each head (partial rotary; PyTorch path)."""
    mod = _native(x)
    if mod is None or x.stride(-1) != 1 or x.stride(-2) != x.shape[-1] or cos.shape[-1] != x.shape[-1]:
        return apply_rotary(x, cos, sin)
    mod.rotary_(x, cos, sin)
    return x


def encoder_attention(qkv: torch.Tensor, starts: torch.Tensor, window: int | None = None) -> torch.Tensor | None:
    """An encoder step's bidirectional attention in one native call (csrc/encoder_attention.cpp): qkv [T, 3, H, D]
    of whole sequences, `starts` [B + 1] host int64 (0, each sequence's end) -> [T, H * D]; None where the native
    kernels are off or the tensors are not CPU float32 (models/bert.py then runs its padded PyTorch path, and
    `bidirectional_ref` is the reference both are tested against)."""
    mod = _native(qkv)
    if mod is None or not hasattr(mod, "encoder_attention"):
        return None
    return mod.encoder_attention(qkv, starts, qkv.shape[-1] ** -0.5, -1 if window is None else window)
