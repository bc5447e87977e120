"""A model built without initialising its parameters: the checkpoint overwrites every one, so nothing is written
(or, on the CPU, even committed) before the weights arrive."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from lmserve.models.config import ModelConfig
from lmserve.models.registry import build_model
from lmserve.models.rope import rope_specs

_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "zeros_", "ones_", "constant_")


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                transform: Callable[[torch.nn.Module], None] | None = None,
                encoder_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Allocate parameters without initialising them (the checkpoint overwrites every one).

    `transform` runs before anything is written (swapping layers for ones that hold real tensors already,
    e.g. GGUF blocks). On the CPU the model is built in place with nn.init skipped, not on the meta
    device: an op on a meta tensor (an initialiser, the rotary frequencies) imports torch._dynamo and
    triton, 153 MiB of RSS a CPU server never uses; the layers a transform replaces were never written,
    so their pages were never committed. Elsewhere it is built on the meta device and only what is
    still there afterwards is allocated.
    `encoder_dtype`: a vision model's tower and projector in this dtype instead (None: `dtype`), before any weight is
    copied in, so each checkpoint tensor is rounded once, to the dtype it serves in.
    """
    if device.type == "cpu":
        with _skip_init():
            net = build_model(cfg)
        if transform is not None:
            transform(net)
        net = net.to(dtype)  # in place: tied parameters stay one
    else:
        with torch.device("meta"):
            net = build_model(cfg)
        if transform is not None:
            transform(net)
        _materialize(net, dtype, device)
    if encoder_dtype is not None:
        encoder_to(net, encoder_dtype)
    # Buffers are not checkpoint tensors: recompute them on the real device, kept in float32.
    if hasattr(net, "rotary"):  # an encoder (models/bert.py) has learned positions
        net.rotary.reset(rope_specs(cfg), device)
    return net


def encoder_to(net: torch.nn.Module, dtype: torch.dtype) -> None:
    """A vision model's tower and projector (the top-level modules its ENCODER_PREFIXES name) cast to `dtype`; the
    text model is left as it is. Their encode_images casts pixels to the tower's dtype; the runner casts the
    embeddings to the text model's where it places them (worker/mm_encoder.py)."""
    for name, child in net.named_children():
        if f"{name}." in getattr(net, "ENCODER_PREFIXES", ()):
            child.to(dtype)


@contextmanager
def _skip_init() -> Iterator[None]:
    """nn.init's initialisers leave tensors as they are (empty: untouched pages) while a model is built."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _materialize(net: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter and buffer by an uninitialised one on `device` (floats in `dtype`).

    One new tensor per meta tensor, so a tied embedding and LM head stay one Parameter.
    """
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor) -> (it, kept alive; its new tensor)

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            made[id(t)] = t, new
        return made[id(t)][1]

    for module in net.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.is_meta:
                module._parameters[name] = real(p)
        for name, b in module.named_buffers(recurse=False):
            if b.is_meta:
                module._buffers[name] = real(b)
