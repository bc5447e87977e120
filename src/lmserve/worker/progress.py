"""Progress inside a step: a counter every decoder layer's forward bumps, read by the hung-step watchdog.

A step over a long prompt on a loaded host can run for minutes and still be healthy; only one that stops making
progress is hung (engine/async_engine.py). The counter is a plain int that the engine thread writes and the
watchdog thread reads (one attribute store: atomic under the GIL). Steps that do not run the module loop (the
native decode stack, CUDA graph replays) do not bump it: they are short, and the step's start counts as progress.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


class LayerProgress:
    """Counts decoder-layer forwards since start, through forward hooks (the model's code is not touched)."""

    def __init__(self, layers: Iterable[nn.Module] = ()) -> None:
        self.count = 0
        for layer in layers:
            layer.register_forward_hook(self._bump)

    def _bump(self, module: nn.Module, args: object, output: object) -> None:
        self.count += 1


def layer_progress(model: nn.Module) -> LayerProgress:
    """The model's layer counter, hooked in by the first runner built over it (engines sharing a loaded model share
    it, rather than stacking one more hook per layer for every engine)."""
    progress = model.__dict__.get("layer_progress")
    if progress is None:
        progress = model.__dict__["layer_progress"] = LayerProgress(decoder_layers(model))
    return progress


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (CausalLM's `model.layers`); [] for a model without them."""
    return list(getattr(getattr(model, "model", None), "layers", None) or ())
