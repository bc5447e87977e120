"""The accepted API keys: `--api-key` / `$LMSERVE_API_KEY` plain keys and the `--api-key-file` entries.

The key file is either a YAML or JSON mapping with a `keys:` list, or one plain key per line (the older
format). Keys are kept only as SHA-256 digests. Every key is its own identity (its name): a named entry's
`name`, or `key-<first 8 hex digits of its SHA-256>` for a plain key, so response-cache entries, shares,
files, batches, rate limits and prefix-cache blocks never cross keys. A key file may not take a name of that
plain form.

An entry may carry `role: admin` (it manages every runtime LoRA adapter and reads /metrics) and
`prefix_cache: shared` (its prompts' KV blocks are shared with other such keys; by default each key's are its
own), and `storage_quota:` its own storage limits (server/quotas.py: files, shares, responses...).
`models` lists the served models, routes and LoRA adapters it may use, as exact names or fnmatch
patterns (`base/*`). `lora_dirs` lists the subdirectories of each --lora-dir it may load runtime adapters
from, as relative paths or fnmatch patterns matched component by component (`team-a`, `shared/*`, `*`); by
default a key's own `<name>` subdirectory only, and every one for an admin key.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from lmserve.config import ENV_API_KEY
from lmserve.errors import ConfigError
from lmserve.server.quotas import parse_key_quota

ANONYMOUS = "anonymous"  # the key name of every request when the server takes no keys
LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")
ROLES = ("user", "admin")
PREFIX_CACHE = ("isolated", "shared")
FIELDS = ("name", "key", "sha256", "models", "role", "prefix_cache", "lora_dirs", "storage_quota", *LIMITS)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # a metric label and a log field: keep it plain
_PLAIN_NAME = re.compile(r"^(key-[0-9a-f]{8}|plain-[0-9]+)$")  # plain keys' names (plain_name), metric labels
_HEX_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def plain_name(key: str) -> str:
    """A plain key's identity: `key-` and the first 8 hex digits of its SHA-256 (a label, never the key)."""
    return "key-" + key_digest(key).hex()[:8]


_EMPTY_DIGEST = key_digest("")


@dataclass(frozen=True)
class KeySpec:
    """One accepted key: its name, its digest, its limits (None: unlimited), models, role and prefix sharing."""

    name: str
    digest: bytes = field(repr=False)  # SHA-256 of the key (the key itself is never kept)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    models: tuple[str, ...] = ("*",)  # exact names or fnmatch patterns of models, routes and adapters
    role: str = "user"  # "admin": manages every runtime adapter, reads /metrics
    prefix_cache: str = "isolated"  # "shared": prompt blocks shared with the other `shared` keys
    plain: bool = False  # from --api-key / $LMSERVE_API_KEY / a one-key-per-line file (no role, no limits)
    lora_dirs: tuple[str, ...] | None = None  # --lora-dir subdirectories (patterns) it may load adapters from
    storage_quota: tuple[tuple[str, int | None], ...] = ()  # (quota name, limit) over the server's --storage-quota

    def allows(self, model: str) -> bool:
        """The key may use `model` (a served model, a route or an adapter): a `models` entry names or matches it."""
        return any(fnmatchcase(model, pattern) for pattern in self.models)

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    def adapter_dirs(self) -> tuple[str, ...] | None:
        """The --lora-dir subdirectory patterns it may load adapters from: as listed, else its own `<name>`
        one (an admin's default: None, every one)."""
        if self.lora_dirs is not None:
            return self.lora_dirs
        return None if self.admin else (self.name,)


# -- the key file ------------------------------------------------------------------------------------


def read_key_file(path: str | Path) -> tuple[list[str], list[KeySpec]]:
    """(plain keys, named keys) from a key file; a malformed named-key file is a ConfigError naming the entry."""
    text = Path(path).read_text(encoding="utf-8")
    specs = parse_key_file(text, f"--api-key-file {path}")
    if specs is not None:
        return [], specs
    keys = [line.strip() for line in text.splitlines()]
    return [k for k in keys if k and not k.startswith("#")], []  # a comment line is not a key


def parse_key_file(text: str, source: str) -> list[KeySpec] | None:
    """The named keys of a YAML/JSON key file; None when the text is not a mapping (then it is one key per line).

    Any mapping counts as the named format, so a misspelt `keys:` is an error rather than a silently accepted key.
    """
    doc = _load_mapping(text)
    if doc is None:
        return None
    unknown = sorted(set(doc) - {"keys"})
    if unknown or not isinstance(doc.get("keys"), list) or not doc["keys"]:
        raise ConfigError(f"{source}: expected a mapping with one field, `keys:`, a non-empty list of keys"
                          + (f" (unknown field {unknown[0]!r})" if unknown else ""))
    specs = [_spec(entry, f"{source}: keys[{i}]") for i, entry in enumerate(doc["keys"])]
    _check_unique(specs, source)
    return specs


def _load_mapping(text: str) -> dict | None:
    """The text as a JSON or YAML mapping, else None (a plain key list is neither, or parses as a string)."""
    import yaml

    try:
        doc = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError):
        return None
    return doc if isinstance(doc, dict) else None


def _spec(entry: Any, where: str) -> KeySpec:
    """One `keys:` entry, checked field by field; errors name the entry (and its name, never its key)."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with name, key or sha256, and limits")
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where}: `name` must be 1-64 letters, digits, '.', '_' or '-' (starting with a letter "
                          f"or digit)")
    where = f"{where} ({name})"
    unknown = sorted(set(entry) - set(FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(FIELDS)})")
    limits = {k: _limit(entry.get(k), f"{where}: {k}") for k in LIMITS}
    try:
        quota = parse_key_quota(entry["storage_quota"], where) if "storage_quota" in entry else ()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return KeySpec(name, _entry_digest(entry, where), models=_models(entry.get("models", ["*"]), where),
                   role=_choice(entry, "role", ROLES, where), prefix_cache=_choice(entry, "prefix_cache",
                                                                                    PREFIX_CACHE, where),
                   lora_dirs=_lora_dirs(entry.get("lora_dirs"), where), storage_quota=quota, **limits)


def _entry_digest(entry: dict, where: str) -> bytes:
    if ("key" in entry) == ("sha256" in entry):
        raise ConfigError(f"{where}: give exactly one of `key` or `sha256`")
    if "key" in entry:
        key = entry["key"]
        if not isinstance(key, str) or not key.strip() or key != key.strip():
            raise ConfigError(f"{where}: `key` must be a non-empty string without surrounding spaces")
        return key_digest(key)
    digest = entry["sha256"]
    if not isinstance(digest, str) or not _HEX_DIGEST.match(digest):
        raise ConfigError(f"{where}: `sha256` must be 64 hex digits (the SHA-256 of the key, e.g. from "
                          f"`printf %s KEY | sha256sum`)")
    if bytes.fromhex(digest) == _EMPTY_DIGEST:
        raise ConfigError(f"{where}: `sha256` is the digest of an empty key")
    return bytes.fromhex(digest)


def _limit(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} must be a positive integer (or absent: unlimited), got {value!r}")
    return value


def _models(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(m, str) and m for m in value):
        raise ConfigError(f"{where}: `models` must be a non-empty list of model or adapter names or patterns "
                          f"(`base/*`), or [\"*\"] for all")
    return tuple(value)


def _lora_dirs(value: Any, where: str) -> tuple[str, ...] | None:
    """Relative subdirectory names or patterns; never absolute, never `..` or `.` (they would leave the key's
    own subdirectory, or name all of --lora-dir). An empty list: no runtime loads."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(d, str) and d for d in value):
        raise ConfigError(f"{where}: `lora_dirs` must be a list of --lora-dir subdirectory names or patterns "
                          f"(`team-a`, `shared/*`, `*`)")
    for d in value:
        if d.startswith("/") or any(part in ("", ".", "..") for part in d.split("/")):
            raise ConfigError(f"{where}: `lora_dirs` entry {d[:80]!r} must be a relative path inside --lora-dir "
                              f"(no leading '/', no '.' or '..', no empty part)")
    return tuple(value)


def _choice(entry: dict, key: str, choices: tuple[str, ...], where: str) -> str:
    """A field with a closed set of values; the first is the default."""
    value = entry.get(key, choices[0])
    if value not in choices:
        raise ConfigError(f"{where}: `{key}` must be one of {', '.join(choices)}, got {value!r}")
    return value


def _check_unique(specs: list[KeySpec], source: str) -> None:
    names, digests = set(), set()
    for s in specs:
        if s.name in names:
            raise ConfigError(f"{source}: key name {s.name!r} is used twice")
        if s.name == ANONYMOUS or _PLAIN_NAME.match(s.name):
            raise ConfigError(f"{source}: key name {s.name!r} is reserved ({ANONYMOUS!r}: requests on a server "
                              f"without keys; key-<8 hex digits>, plain-<N>: plain --api-key keys)")
        if s.digest in digests:
            raise ConfigError(f"{source}: key {s.name!r} has the same key as an earlier entry")
        names.add(s.name)
        digests.add(s.digest)


def key_specs(plain_keys: tuple[str, ...], named: tuple[KeySpec, ...]) -> tuple[KeySpec, ...]:
    """All accepted keys: the named ones, then each plain key (unlimited, all models) under its own name."""
    plain: dict[str, KeySpec] = {}
    named_digests = {s.digest for s in named}
    for key in dict.fromkeys(k for k in plain_keys if k):
        spec = KeySpec(plain_name(key), key_digest(key), plain=True)
        if spec.digest in named_digests:
            raise ConfigError("--api-key-file: a plain key (--api-key, $LMSERVE_API_KEY) is also the key of a "
                              "named entry; give it once")
        if spec.name in plain:  # two keys whose digests start alike: 1 in 4 billion, but say so
            raise ConfigError(f"two plain API keys share the name {spec.name!r}; change one of them")
        plain[spec.name] = spec
    return named + tuple(plain.values())


def api_keys(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[KeySpec, ...]]:
    """(plain keys, named keys): --api-key (repeatable), $LMSERVE_API_KEY (comma-separated), and --api-key-file:
    a YAML/JSON file of named keys with limits, or one plain key per line."""
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get(ENV_API_KEY, "").split(",") if k.strip()]
    named: list[KeySpec] = []
    if args.api_key_file:
        plain, named = read_key_file(args.api_key_file)
        keys += plain
    key_specs(tuple(keys), tuple(named))  # a name clash between the two is a ConfigError now, not at start
    return tuple(keys), tuple(named)


def read_api_keys(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[KeySpec, ...]]:
    """api_keys(), with an unreadable key file as a ConfigError (a malformed one already is one), and none at all
    a ConfigError under --require-api-key."""
    try:
        keys = api_keys(args)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--api-key-file: {e}") from None
    if args.require_api_key and not key_specs(*keys):
        raise ConfigError(f"--require-api-key: no API key was given (--api-key, ${ENV_API_KEY} or a non-empty "
                          "--api-key-file); refusing to serve an open API")
    return keys
