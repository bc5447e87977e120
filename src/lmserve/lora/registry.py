"""Which adapters a server knows (name -> directory) and an LRU of those read into host memory.

Thread-safe: the server reads adapters from disk on worker threads (never on the engine thread or the
event loop). Up to `max_cpu_loras` stay read; the least recently used is dropped past that (a request
already holding it keeps its tensors alive; the next request re-reads it from disk). Each registration
gets a fresh `lora_int_id`: unloading a name and loading it again never reuses the old slot or cache blocks.
A registration also keeps the digest of the bytes it read: a re-read (after the LRU dropped the adapter) that
finds other bytes is refused, so the digest always names what answers under that registration.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lmserve.config import LoraConfig
from lmserve.lora.peft_adapter import AdapterError, PeftAdapter, read_peft_adapter
from lmserve.models.config import ModelConfig
from lmserve.request import LoRARequest

log = logging.getLogger(__name__)


class AdapterNameTaken(AdapterError):
    """register() of a name that is already registered."""


@dataclass(frozen=True)
class Registration:
    """A known adapter: its name, the id of this registration, its directory and the digest of its files."""

    name: str
    lora_int_id: int
    path: str
    digest: str  # PeftAdapter.digest of the bytes read at registration
    root: str | None = None  # the --lora-dir (sub)directory it must stay inside (a runtime load); None: the operator's path


class LoraRegistry:
    """Adapter names -> directories, and the host-memory LRU of adapters read from them."""

    def __init__(self, cfg: LoraConfig, model_config: ModelConfig, slot_dtype: torch.dtype | None = None) -> None:
        """`slot_dtype`: the device slots' (--lora-dtype resolved); float16 refuses adapters past its range."""
        self.cfg, self.model_config, self.slot_dtype = cfg, model_config, slot_dtype
        self._known: dict[str, Registration] = {}
        self._cpu: OrderedDict[int, PeftAdapter] = OrderedDict()  # lora_int_id -> adapter, least recent first
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.num_loads = 0  # reads from disk
        self.num_evictions = 0  # adapters dropped from host memory by the LRU
        self.load_listeners: list[Callable[[float], None]] = []  # seconds of each read from disk (metrics)

    def names(self) -> list[str]:
        """Registered adapter names, in registration order."""
        with self._lock:
            return list(self._known)

    def registrations(self) -> list[Registration]:
        with self._lock:
            return list(self._known.values())

    def lookup(self, name: str) -> Registration | None:
        with self._lock:
            return self._known.get(name)

    def register(self, name: str, path: str | Path, root: str | Path | None = None) -> LoRARequest:
        """Read and check the adapter (blocking: call off the engine thread), then make it known under `name`.

        `root`: the --lora-dir every file it reads must stay inside (read_peft_adapter), now and on re-reads."""
        with self._lock:
            if name in self._known:
                raise AdapterNameTaken(f"an adapter named {name!r} is already loaded")
        reg = Registration(name, next(self._ids), str(path), "", None if root is None else str(root))
        adapter = self._read(reg)
        reg = dataclasses.replace(reg, digest=adapter.digest)
        with self._lock:
            if name in self._known:  # another thread registered it while this one read
                raise AdapterNameTaken(f"an adapter named {name!r} is already loaded")
            self._known[name] = reg
            self._cache(reg.lora_int_id, adapter)
        return LoRARequest(name, reg.lora_int_id, reg.path, adapter)

    def unregister(self, name: str) -> bool:
        """Forget `name` (new requests cannot use it); requests holding it finish with their own copy."""
        with self._lock:
            reg = self._known.pop(name, None)
            if reg is not None:
                self._cpu.pop(reg.lora_int_id, None)
            return reg is not None

    def get(self, name: str) -> LoRARequest | None:
        """The adapter for a request, read from disk unless cached (blocking); None for an unknown name."""
        with self._lock:
            reg = self._known.get(name)
            if reg is None:
                return None
            adapter = self._cpu.get(reg.lora_int_id)
            if adapter is not None:
                self._cpu.move_to_end(reg.lora_int_id)
                return LoRARequest(name, reg.lora_int_id, reg.path, adapter)
        adapter = self._read(reg)  # outside the lock: other adapters stay servable while this one reads
        if adapter.digest != reg.digest:
            log.warning("LoRA adapter %r: the files in %s changed since it was loaded (digest %s, now %s); refused",
                        name, reg.path, reg.digest[:12], adapter.digest[:12])
            raise AdapterError(f"adapter {name!r}: its files changed on disk since it was loaded; load it again")
        with self._lock:
            if reg.lora_int_id not in self._cpu and self._known.get(name) is reg:
                self._cache(reg.lora_int_id, adapter)
        return LoRARequest(name, reg.lora_int_id, reg.path, adapter)

    def cached_ids(self) -> list[int]:
        """lora_int_ids held in host memory, least recently used first."""
        with self._lock:
            return list(self._cpu)

    def _read(self, reg: Registration) -> PeftAdapter:
        start = time.perf_counter()
        adapter = read_peft_adapter(reg.path, self.model_config, name=reg.name, max_rank=self.cfg.max_lora_rank,
                                    root=reg.root)
        seconds = time.perf_counter() - start
        largest = adapter.largest_slot_value()
        if not math.isfinite(largest):
            raise AdapterError(f"adapter {reg.name!r}: its weights (B times its scaling, or A) are not all finite")
        if self.slot_dtype == torch.float16 and largest > torch.finfo(torch.float16).max:
            # refused, never saturated: the adapter would answer with other weights than its file's
            log.warning("LoRA adapter %r refused: past float16's range (--lora-dtype)", reg.name)
            raise AdapterError(f"adapter {reg.name!r}: its weights (B times its scaling, or A) go past float16's range, "
                               "the device slots' type (--lora-dtype); serve it with --lora-dtype float32 or bfloat16")
        with self._lock:
            self.num_loads += 1
        for listener in self.load_listeners:
            listener(seconds)
        log.info("LoRA adapter %r read from %s in %.3f s (rank %d, %s)", reg.name, reg.path, seconds, adapter.rank,
                 ", ".join(adapter.target_modules))
        return adapter

    def _cache(self, lora_int_id: int, adapter: PeftAdapter) -> None:
        """Insert under the lock; drop the least recently used past max_cpu_loras."""
        self._cpu[lora_int_id] = adapter
        self._cpu.move_to_end(lora_int_id)
        while len(self._cpu) > self.cfg.max_cpu_loras:
            self._cpu.popitem(last=False)
            self.num_evictions += 1
