"""Device slots: which adapters the model can run this step, and the wrappers that hold their weights.

`LoraSlots` wraps the target linears of a finished model once (any weight format), then, on the engine
thread, gives an adapter a slot when the scheduler admits a request for it: the adapter's slot if it has
one, else an empty slot, else the least recently used slot that no running request uses (its weights are
overwritten: a few hundred small copies, no disk). A slot is never taken from a running request's adapter.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from torch import nn

from lmserve.lora.batch import lora_segments
from lmserve.lora.layers import LoraBatch, LoraLinear, LoraMeta, LoraSlice
from lmserve.models.config import ModelConfig
from lmserve.request import LoRARequest


def target_slices(cfg: ModelConfig) -> dict[str, list[LoraSlice]]:
    """Model attribute path (within a decoder layer) -> the HF projections it holds, as stacked in models/decoder.py."""
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {
        "self_attn.qkv_proj": [LoraSlice("q_proj", 0, q), LoraSlice("k_proj", q, kv), LoraSlice("v_proj", q + kv, kv)],
        "self_attn.o_proj": [LoraSlice("o_proj", 0, cfg.hidden_size)],
        "mlp.gate_up_proj": [LoraSlice("gate_proj", 0, inter), LoraSlice("up_proj", inter, inter)],
        "mlp.down_proj": [LoraSlice("down_proj", 0, cfg.hidden_size)],
    }


class LoraSlots:
    """max_loras device slots over a model whose target linears it has wrapped."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_loras, self.max_rank, self.lora_dtype = max_loras, max_rank, dtype
        self.batch = LoraBatch()
        # (layer index, HF projection name) -> (wrapper, index of its slice)
        self.targets: dict[tuple[int, str], tuple[LoraLinear, int]] = {}
        for idx, layer in enumerate(model.model.layers):
            for path, slices in target_slices(cfg).items():
                if path.startswith("mlp.") and cfg.is_moe_layer(idx):
                    continue  # experts take no adapters (lora/peft_adapter.py refuses them)
                parent_path, attr = path.rsplit(".", 1)
                parent = layer.get_submodule(parent_path)
                in_features = cfg.intermediate_size if attr == "down_proj" else (
                    cfg.q_size if attr == "o_proj" else cfg.hidden_size)
                wrapper = LoraLinear(getattr(parent, attr), slices, self.batch, max_loras, max_rank, in_features,
                                     dtype, device)
                setattr(parent, attr, wrapper)
                for i, s in enumerate(slices):
                    self.targets[(idx, s.name)] = (wrapper, i)
        self.wrappers = list(dict.fromkeys(w for w, _ in self.targets.values()))
        self.slot_ids: list[int | None] = [None] * max_loras  # lora_int_id held by each slot
        self.slot_names: list[str | None] = [None] * max_loras
        self.slot_ranks = [0] * max_loras
        self._last_used = [0] * max_loras
        self._clock = itertools.count(1)

    @property
    def bytes_per_slot(self) -> int:
        """Device memory one slot takes (A and B of every wrapper at max_rank)."""
        total = sum(w.lora_a[0].numel() * w.lora_a.element_size() for w in self.wrappers)
        total += sum(w.lora_b(i)[0].numel() * w.lora_a.element_size() for w in self.wrappers
                     for i in range(len(w.slices)))
        return total

    def slot_of(self, lora: LoRARequest | None) -> int:
        """The adapter's slot, -1 for the base model (the scheduler asked acquire first)."""
        if lora is None:
            return -1
        return self.slot_ids.index(lora.lora_int_id)

    def acquire(self, lora: LoRARequest, busy: set[int]) -> bool:
        """Give `lora` a slot (writing its weights if it has none); False when every slot serves a busy adapter."""
        if lora.lora_int_id in self.slot_ids:
            self._last_used[self.slot_ids.index(lora.lora_int_id)] = next(self._clock)
            return True
        free = [s for s in range(self.max_loras) if self.slot_ids[s] is None]  # lowest first: segments stay few
        if not free:
            free = sorted((s for s in range(self.max_loras) if self.slot_ids[s] not in busy),
                          key=lambda s: self._last_used[s])
        if not free:
            return False
        self._write(free[0], lora)
        return True

    def _write(self, slot: int, lora: LoRARequest) -> None:
        """Zero the slot in every wrapper, then copy each module's A and B (scaling folded into B)."""
        with torch.no_grad():
            for w in self.wrappers:
                w.lora_a[slot].zero_()
                for i in range(len(w.slices)):
                    w.lora_b(i)[slot].zero_()
            adapter = lora.adapter
            for (layer, proj), module in adapter.modules.items():
                wrapper, i = self.targets[(layer, proj)]
                r = module.a.shape[0]
                wrapper.lora_a[slot, :r, i].copy_(module.a)
                wrapper.lora_b(i)[slot, :r].copy_((module.b * module.scaling).T)
        self.slot_ids[slot], self.slot_names[slot] = lora.lora_int_id, lora.name
        self.slot_ranks[slot] = adapter.rank
        self._last_used[slot] = next(self._clock)

    def step_meta(self, slots: np.ndarray) -> LoraMeta | None:
        """This step's segments from the per-token slots (numpy; the runner uploads them with its inputs)."""
        return lora_segments(slots, self.slot_ranks)
