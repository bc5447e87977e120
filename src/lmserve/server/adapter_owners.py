"""Who may load and unload which runtime LoRA adapter (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter).

The key that loads an adapter owns that registration; the adapters named by --lora-modules belong to the
operator. A `role: admin` key manages every adapter (on a server without keys everyone is admin); any other
key manages only its own:

- load under a name outside its namespace (`<key name>/...`, so no key can take a name another key's requests
  will ask for) or that its `models` does not cover: 403; under a name already loaded: 409 (unload it first,
  which only its owner or an admin may).
- load from a directory outside the --lora-dir subdirectories its key entry allows (`lora_dirs`; by default
  its own `<key name>` one, an admin's all): 403 (allowed_root).
- unload a name its `models` does not cover, or that is not loaded: 404 (it cannot see it); a name another key
  or the operator owns: 403.

Ownership is per registration (its lora_int_id). A model that unloads (a request's keep_alive 0, its
keep-alive running out, an LRU eviction) keeps its runtime registrations here with their owners, and its next
load registers them again from the same directories (`keep`, `restore`), so no key's adapter goes with the
model; one whose files changed or went meanwhile is dropped with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from lmserve.lora.peft_adapter import AdapterError
from lmserve.lora.registry import LoraRegistry, Registration
from lmserve.server.errors import APIError, excerpt
from lmserve.server.tenants import Tenants

log = logging.getLogger("lmserve.server")
OPERATOR = None  # the owner of --lora-modules adapters (and of any registration without an entry)


@dataclass(frozen=True)
class Ownership:
    """The key that loaded one registration of an adapter name."""

    lora_int_id: int
    key_name: str


@dataclass(frozen=True)
class Kept:
    """A runtime registration of a model that is not loaded now, and the key that loaded it."""

    reg: Registration
    owner: str | None


class AdapterOwners:
    """Adapter name -> the key that loaded its current registration; checks for the load and unload routes; the
    runtime adapters of unloaded models, by model name, for their next load."""

    def __init__(self) -> None:
        self._by_name: dict[str, Ownership] = {}
        self._kept: dict[str, list[Kept]] = {}  # model name -> its runtime adapters as it unloaded

    def owner(self, reg: Registration) -> str | None:
        """The key name that loaded `reg`, or OPERATOR."""
        entry = self._by_name.get(reg.name)
        return entry.key_name if entry is not None and entry.lora_int_id == reg.lora_int_id else OPERATOR

    def check_load(self, tenants: Tenants, key: str, name: str, loras: LoraRegistry) -> None:
        """May `key` load an adapter called `name`? 403 outside its namespace or models, 409 if the name is taken."""
        if not tenants.is_admin(key) and not (name.startswith(f"{key}/") and len(name) > len(key) + 1):
            raise APIError(403, f"this key may load adapters only under its own name, {key}/NAME, not "
                           f"{excerpt(name)} (an admin key may use any name)", param="lora_name",
                           code="permission_denied")
        if not tenants.allows(key, name):
            raise APIError(403, f"this key may not use the name {excerpt(name)} (its `models` do not cover it)",
                           param="lora_name", code="permission_denied")
        if loras.lookup(name) is not None:
            raise taken(name)

    def loaded(self, key: str, reg: Registration) -> None:
        """`key` has registered `reg`: it owns it."""
        self._by_name[reg.name] = Ownership(reg.lora_int_id, key)

    def check_unload(self, tenants: Tenants, key: str, name: str, loras: LoraRegistry) -> Registration:
        """The registration `key` may unload; 404 if it cannot see one, 403 if another key or the operator owns it."""
        reg = loras.lookup(name) if tenants.allows(key, name) else None
        if reg is None:
            raise APIError(404, f"no LoRA adapter named {excerpt(name)} is loaded", param="lora_name",
                           code="model_not_found")
        owner = self.owner(reg)
        if owner != key and not tenants.is_admin(key):
            whose = "the operator (--lora-modules)" if owner is OPERATOR else "another key"
            raise APIError(403, f"the LoRA adapter {excerpt(name)} belongs to {whose}; only it or an admin key "
                           "may unload it", param="lora_name", code="permission_denied")
        return reg

    def unloaded(self, reg: Registration) -> None:
        entry = self._by_name.get(reg.name)
        if entry is not None and entry.lora_int_id == reg.lora_int_id:
            del self._by_name[reg.name]

    def keep(self, model: str, loras: LoraRegistry | None) -> None:
        """`model` is unloading: remember its runtime registrations and their owners for its next load."""
        regs = [reg for reg in (loras.registrations() if loras is not None else ()) if reg.root is not None]
        self._kept[model] = [Kept(reg, self.owner(reg)) for reg in regs]
        for reg in regs:  # the next engine numbers its registrations afresh: an old entry must own nothing
            self.unloaded(reg)

    def kept(self, model: str, name: str) -> bool:
        """`model`, not loaded now, will have an adapter called `name` again when it loads."""
        return name in self.kept_names(model)

    def kept_names(self, model: str) -> list[str]:
        """The runtime adapters `model`, not loaded now, will have again when it loads."""
        return [k.reg.name for k in self._kept.get(model, ())]

    def restore(self, model: str, loras: LoraRegistry | None) -> None:
        """`model` has loaded again (blocking, before it serves): register its kept adapters, owners included.

        The list stays until the next unload replaces it, so a request that resolves a kept name while the
        engine is being published still finds the model."""
        for k in self._kept.get(model, ()) if loras is not None else ():
            try:
                loras.register(k.reg.name, k.reg.path, k.reg.root)
            except AdapterError as e:  # its files went, or a name now taken (--lora-modules)
                log.warning("model %s: LoRA adapter %r was not loaded again (%s)", model, k.reg.name, e)
                continue
            reg = loras.lookup(k.reg.name)
            if reg.digest != k.reg.digest:  # other weights must not answer under the old registration's name
                loras.unregister(reg.name)
                log.warning("model %s: LoRA adapter %r was not loaded again: its files changed since it was "
                            "loaded", model, k.reg.name)
            elif k.owner is not OPERATOR:
                self.loaded(k.owner, reg)


def allowed_root(path: Path, root: Path, patterns: tuple[str, ...] | None) -> Path | None:
    """The directory under the --lora-dir `root` that a load of `path` (resolved, inside `root`) must stay
    inside, for a key allowed the subdirectory `patterns` (fnmatch, per path component; None: all of `root`);
    None when no pattern covers `path`. Every file read later must resolve inside it too (a symlink out of the
    key's own subdirectory into another key's is refused)."""
    if patterns is None:
        return root
    parts = path.relative_to(root).parts
    for pattern in patterns:
        want = pattern.split("/")
        if len(parts) >= len(want) and all(fnmatchcase(p, w) for p, w in zip(parts, want)):
            return root.joinpath(*parts[:len(want)])
    return None


def taken(name: str) -> APIError:
    """409: a name already loaded (by this key, another or the operator) cannot be loaded again until unloaded."""
    return APIError(409, f"a LoRA adapter named {excerpt(name)} is already loaded; unload it first (its owner or an "
                    "admin key may)", param="lora_name", code="adapter_name_taken")
