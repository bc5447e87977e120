"""Weight-only int8 / int4 linear layers (CPU and CUDA), applied as a transform to a finished model.

Why: a batch-1 decode step reads every weight once, so fewer bytes per weight is the lever for
single-stream speed (and it cuts resident memory ~4x/~7x). Activations stay in the model's float
dtype outside the matmul; inside, torch's weight-only kernels (`_weight_int4pack_mm[_for_cpu]`,
`_weight_int8pack_mm`) take bfloat16 activations: the only dtype they vectorise on CPU (float32 runs
a scalar loop ~10x slower) and the only one the CUDA int4 kernel takes. Measured on a 2-core AMD
CPU for the embedded model's 120 decoder GEMVs at batch 1: fp32 oneDNN 18.9 ms, int4 9.5 ms, int8
11.2 ms; from ~8 tokens per step on the fp32 path is faster again (these kernels are compute-bound),
so quantization is opt-in.

int4: groups of 32 input columns, asymmetric (w = q * scale + min, q in 0..15), round-to-nearest from
the loaded float weights. A GGUF Q4_1 tensor is exactly such a grid (llama.cpp's min/max rounding),
so requantizing its dequantized values gives back the file's own 4-bit codes: "kept quantized".
int8: one symmetric scale per output row. The LM head gets int8 in both modes: its errors move the
logits directly, and the embedded model ships it as Q8_0.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

SCHEMES = ("int8", "int4")
INT4_GROUP = 32
_ACT = torch.bfloat16  # the activation dtype the CPU weight-only kernels are fast in


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] -> (codes uint8 [N, K] in 0..15, scale [N, K/group], min [N, K/group]), all from float32.

    w ~= codes * scale + min within each group of `group` consecutive input columns.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code 0
    codes = torch.round((g - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return codes.reshape(n, k), scale, lo


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_int4, in float32 (the reference the tests compare against)."""
    n, k = codes.shape
    group = k // scale.shape[1]
    g = codes.reshape(n, -1, group).float() * scale[..., None] + lo[..., None]
    return g.reshape(n, k)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (int8 [N, K], scale [N]) with w ~= q * scale, symmetric per output row."""
    w = w.float()
    scale = w.abs().amax(1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8), scale


class Int4Linear(nn.Module):
    """y = x W^T + b with W stored as 4-bit codes, group-wise scale and min (torch's packed layout)."""

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = linear.in_features, linear.out_features, group
        codes, scale, lo = quantize_int4(linear.weight.detach(), group)
        self.register_buffer("packed", _pack_int4(codes))
        # the kernel computes (q - 8) * scale + zero, so zero = min + 8 * scale; layout [K/group, N, 2]
        sz = torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_zeros", sz.to(_ACT))
        self.bias = _bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(_ACT)
        mm = torch.ops.aten._weight_int4pack_mm if flat.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(flat, self.packed, self.group, self.scales_zeros)
        return _finish(y, x, self.out_features, self.bias)


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..15 -> torch's packed int4 layout for the codes' device (CPU and CUDA differ)."""
    if codes.is_cuda:  # CUDA (tinygemm) takes two codes per byte, even column in the high nibble
        pairs = (codes[:, ::2].to(torch.int32) << 4 | codes[:, 1::2].to(torch.int32)).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, 2)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 and one scale per output row."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_int8(linear.weight.detach())
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale.to(_ACT))
        self.bias = _bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(_ACT)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scale)
        return _finish(y, x, self.out_features, self.bias)


def _bias(linear: nn.Linear) -> nn.Parameter | None:
    return None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(), requires_grad=False)


def _finish(y: torch.Tensor, x: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    y = y.to(x.dtype).reshape(*x.shape[:-1], out_features)
    return y if bias is None else y + bias.to(x.dtype)


def int4_supported(linear: nn.Linear, group: int = INT4_GROUP) -> bool:
    """The packed int4 layout needs whole groups along K and N a multiple of 16 (checked, not assumed)."""
    return linear.in_features % group == 0 and linear.out_features % 16 == 0


def check_scheme(scheme: str, device: torch.device) -> None:
    """Refuse what this build cannot run, before anything is loaded (auto and none always run)."""
    if scheme in ("auto", "none"):  # auto resolves to none wherever gguf cannot run (loader/model_loader.load_model)
        return
    if scheme == "gguf":  # a GGUF file's own blocks (layers/formats/gguf_linear.py): the native CPU kernel reads them
        if device.type != "cpu":
            raise ValueError(f"quantization 'gguf' runs on CPU, not on {device} (use int4 or int8 there)")
        return
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r} (choose from auto, none, {', '.join(SCHEMES)}, gguf)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"quantization {scheme!r} runs on CPU or CUDA, not on {device}")


def quantize_linears(model: nn.Module, scheme: str) -> nn.Module:
    """Replace the decoder's nn.Linear layers (int8 or int4) and the LM head (int8), in place."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r} (choose from {', '.join(SCHEMES)})")
    lm_head = getattr(model, "lm_head", None)
    kept = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if child is lm_head or scheme == "int8":
                setattr(parent, name, Int8Linear(child))
            elif int4_supported(child):
                setattr(parent, name, Int4Linear(child))
            else:
                kept += 1  # stays in float: its shape does not fit the packed int4 layout
    if kept:
        log.warning("int4: %d linear layer(s) keep float weights (shape not a multiple of the int4 layout)", kept)
    return model
