"""Who may load and unload which runtime LoRA adapter (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter).

The key that loads an adapter owns that registration; the adapters named by --lora-modules belong to the
operator. A `role: admin` key manages every adapter (on a server without keys everyone is admin); any other
key manages only its own:

- load under a name its `models` does not cover: 403; under a name already loaded: 409 (unload it first,
  which only its owner or an admin may).
- unload a name its `models` does not cover, or that is not loaded: 404 (it cannot see it); a name another key
  or the operator owns: 403.

Ownership is per registration (its lora_int_id), so an entry left by an engine that was unloaded and loaded
again, or by a registration that is gone, owns nothing: an adapter with no entry is the operator's.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmserve.lora.registry import LoraRegistry, Registration
from lmserve.server.errors import APIError, excerpt
from lmserve.server.tenants import Tenants

OPERATOR = None  # the owner of --lora-modules adapters (and of any registration without an entry)


@dataclass(frozen=True)
class Ownership:
    """The key that loaded one registration of an adapter name."""

    lora_int_id: int
    key_name: str


class AdapterOwners:
    """Adapter name -> the key that loaded its current registration; checks for the load and unload routes."""

    def __init__(self) -> None:
        self._by_name: dict[str, Ownership] = {}

    def owner(self, reg: Registration) -> str | None:
        """The key name that loaded `reg`, or OPERATOR."""
        entry = self._by_name.get(reg.name)
        return entry.key_name if entry is not None and entry.lora_int_id == reg.lora_int_id else OPERATOR

    def check_load(self, tenants: Tenants, key: str, name: str, loras: LoraRegistry) -> None:
        """May `key` load an adapter called `name`? 403 outside its models, 409 if the name is taken."""
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


def taken(name: str) -> APIError:
    """409: a name already loaded (by this key, another or the operator) cannot be loaded again until unloaded."""
    return APIError(409, f"a LoRA adapter named {excerpt(name)} is already loaded; unload it first (its owner or an "
                    "admin key may)", param="lora_name", code="adapter_name_taken")
