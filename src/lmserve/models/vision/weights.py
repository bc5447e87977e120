"""A checkpoint's vision tensors under a tower's names: the one place that knows how HF checkpoints spell them.

Checkpoints saved by transformers 4 and 5 differ only in prefixes (`vision_tower.vision_model.x` vs
`model.vision_tower.x`), so a tensor's name loses a leading `model.` and any `vision_model.` level, is renamed by
the family's prefix map, and is kept only if the map names it and no `drop` fragment is in it. The tower then loads
strictly, so a missing or unexpected tensor fails the load instead of leaving random weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def vision_state(tensors: Mapping[str, torch.Tensor], prefixes: Mapping[str, str],
                 drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The tensors whose (normalised) names start with a key of `prefixes`, renamed to its value."""
    out = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.").replace("vision_model.", "")
        for src, dst in prefixes.items():
            if name.startswith(src) and not any(d in name for d in drop):
                out[dst + name[len(src):]] = t
                break
    return out


def load_vision(module: nn.Module, tensors: Mapping[str, torch.Tensor], prefixes: Mapping[str, str],
                drop: tuple[str, ...] = ()) -> None:
    """Load a family's vision tensors into `module`, strictly."""
    module.load_state_dict(vision_state(tensors, prefixes, drop), strict=True)
