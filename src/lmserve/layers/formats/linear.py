"""Weight formats for linear layers, applied as a transform to a finished model.

On CPU, PyTorch's default fp32 GEMM goes through MKL, which takes slow generic paths on non-Intel
CPUs (measured here on AMD EPYC: 13 GB/s for a batch-1 GEMV against 27 GB/s of memory bandwidth).
oneDNN's pre-packed weights use JIT AVX2/AVX-512 kernels on any x86 CPU: 1.7x faster at batch 1,
3x at batch 4, 1.3x at batch 32+. The plain `nn.Linear` stays the reference path.

Steps with at most SKINNY_MAX_ROWS rows (decoding one to a few sequences; an encoder's steps of up to
ENCODER_SKINNY_ROWS tokens on AVX2 CPUs) read their weights from a second copy in panel layout through the
native skinny kernel (layers/kernels/csrc/gemv.cpp), which streams them faster than oneDNN. It is used only
for layers where it gives oneDNN's exact bits (checked at load), so a sequence's tokens never depend on
which of the two ran its step.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import nn

from lmserve.layers.kernels.native import native_module

log = logging.getLogger(__name__)

# Steps of up to 8 rows (a verify step with up to 7 drafts) run the skinny kernel: on the embedded model's
# shapes it beats oneDNN at every M = 1..8 (1.1-1.7x per layer; all linear layers of a forward 31-40 ms
# against 39-59 ms; benchmarks/results/skinny_rows.md). Past 8 rows it rereads each panel per 8 rows.
SKINNY_MAX_ROWS = 8
# An encoder's step of up to 64 tokens (a query, a short passage) runs it too, where oneDNN's GEMM is AVX2's (no
# AVX-512 here; the skinny kernel has no 512-bit code, so there oneDNN's wider GEMM keeps these steps, unmeasured).
# all-MiniLM-L6-v2's 24 linears, weights cold as in a served step: 16 rows 7.2 ms against oneDNN's 10.4, 64 rows
# 26.2 against 28.7, about even at 96, slower from 128 (Zen 1, 2 threads). The larger gain is after a pause: each
# oneDNN call opens an OpenMP region whose sleeping thread must be woken, one sentence's embedding 100 ms after the
# last took 25.2 ms against 17.5 back to back; on the skinny kernel's own pool 17.4 (benchmarks/results/
# encoder_short_steps_zen1.md).
ENCODER_SKINNY_ROWS = 64
PANEL = 16  # output columns per panel, as in gemv.cpp
# Row counts checked at load: gemv.cpp runs rows in groups of 4 and then one group of 3, 2 or 1, so
# 1 (1), 3 (3), 6 (4 + 2) and 8 (4 + 4) exercise every group size.
CHECK_ROWS = (1, 3, 6, 8)


class PackedLinear(nn.Module):
    """y = x W^T + b with W pre-packed by oneDNN (CPU, float32 or bfloat16), plus skinny-kernel panels."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        with torch.no_grad():
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.register_buffer("panels", None)  # [N/16, K, 16] for the skinny kernel, where it matches oneDNN
        self.skinny_rows = SKINNY_MAX_ROWS  # steps of at most this many rows run it (an encoder's: widen_skinny_steps)
        self.skinny_checked = weight.dtype == torch.float32 and native_module() is not None
        if self.skinny_checked:
            panels = to_panels(weight)
            if self._skinny_matches_onednn(panels):
                self.panels = panels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.dim() == 2 and x.shape[0] <= self.skinny_rows:
            mod = native_module()  # None when switched off after load (tests)
            if mod is not None:
                return mod.skinny_linear(x, self.panels, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _skinny_matches_onednn(self, panels: torch.Tensor) -> bool:
        """True when the skinny kernel's rows are oneDNN's bits for this layer in a batch that oneDNN runs."""
        # more rows than any skinny step: the bits a row gets when its step is too big for the kernel
        x = torch.randn(SKINNY_MAX_ROWS + 8, self.in_features, generator=torch.Generator().manual_seed(0))
        full = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        mod = native_module()
        same = all(torch.equal(mod.skinny_linear(x[:m], panels, self.out_features, self.bias), full[:m])
                   for m in CHECK_ROWS if m <= SKINNY_MAX_ROWS)
        if not same:  # one summary line at INFO comes from the loader (skinny_coverage)
            log.debug("skinny kernel differs from oneDNN for a [%d x %d] layer; it keeps oneDNN only",
                     self.out_features, self.in_features)
        return same


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: each panel's 16 output columns side by side, k-major (zero padded)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


class SkinnyCoverage(NamedTuple):
    """How many packed layers passed the load-time check (`used`) out of those checked (`checked`)."""

    used: int
    checked: int


def skinny_coverage(model: nn.Module) -> SkinnyCoverage:
    """Count the PackedLinear layers of `model` that run the skinny kernel for small steps."""
    checked = [m for m in model.modules() if isinstance(m, PackedLinear) and m.skinny_checked]
    return SkinnyCoverage(sum(m.panels is not None for m in checked), len(checked))


def widen_skinny_steps(model: nn.Module, flags: str | None = None) -> int:
    """An encoder's short steps on the skinny kernel (ENCODER_SKINNY_ROWS rows) on an AVX2 CPU without AVX-512; every
    row keeps oneDNN's bits (the load-time check: the kernel runs a step in slabs of at most 8 rows, each the
    arithmetic of a checked small step). Returns the layers widened."""
    from lmserve.utils import cpu_flags

    have = (cpu_flags() if flags is None else flags).split()
    if "avx2" not in have or "avx512f" in have:  # measured where oneDNN's GEMM and the kernel are both AVX2's
        return 0
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.panels is not None]
    for m in layers:
        m.skinny_rows = ENCODER_SKINNY_ROWS
    return len(layers)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing: CPU float32 anywhere; bf16 only with native bf16 (oneDNN refuses it otherwise)."""
    from lmserve.utils import cpu_has_fast_bf16

    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_fast_bf16())


def pack_linears(model: nn.Module, packable: dict[torch.dtype, bool] | None = None) -> nn.Module:
    """Replace every nn.Linear in `model` whose dtype oneDNN packs here (`can_pack`) by a PackedLinear (weights are
    copied into packed form); a vision tower may hold another dtype than the text model (--mm-encoder-dtype).
    `packable`: can_pack's answer per dtype, asked once."""
    packable = {} if packable is None else packable
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            dtype = child.weight.dtype
            if dtype not in packable:
                packable[dtype] = can_pack(child.weight.device, dtype)
            if packable[dtype]:
                setattr(model, name, PackedLinear(child))
        else:
            pack_linears(child, packable)
    return model
