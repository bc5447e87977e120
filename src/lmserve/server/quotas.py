"""What one API key may keep on the server's disk: files, playground shares, stored responses, response-cache entries.

Every key gets the server's defaults (`--storage-quota NAME=VALUE`, repeatable), and a key file entry may set its
own (`storage_quota: {files: 50, file_bytes: 1GiB}`). The stores count per key name and enforce them:

- files and shares are the caller's to manage, so one past the limit is refused (400 `quota_exceeded`, OpenAI's
  error body: a client should delete some, not retry; the openai client retries a 429 twice on its own);
- stored responses are kept by default (`store: true`), so past the limit the key's oldest are dropped, as OpenAI
  expires them; a `previous_response_id` chain longer than `response_chain` is a 400;
- response-cache entries: a key holding its share evicts only its own oldest entries, never another key's.

The defaults suit one machine serving a handful of teams (OpenAI allows 512 MB per file and 100 GB per
organisation; here a file is at most --max-upload-bytes, 64 MiB by default).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from lmserve.units import parse_bytes

# The quotas measured in bytes take sizes as people write them (2GiB); the others are counts.
BYTE_QUOTAS = ("file_bytes", "share_bytes", "response_bytes")


@dataclass(frozen=True)
class StorageQuota:
    """Per-key storage limits; None: unlimited. `cache_entries` None: the cache's size shared equally by the keys."""

    files: int | None = 1_000  # uploaded files and batch results kept
    file_bytes: int | None = 4 * 2**30  # their total size
    shares: int | None = 1_000  # playground permalinks (each at most 1 MB)
    share_bytes: int | None = 100 * 2**20
    responses: int | None = 10_000  # stored /v1/responses answers; past it the oldest are dropped
    response_bytes: int | None = 2**30
    response_chain: int | None = 1_000  # turns in one previous_response_id chain
    cache_entries: int | None = None  # response-cache entries; None: --response-cache-max-entries / number of keys

    def merged(self, overrides: tuple[tuple[str, int | None], ...]) -> StorageQuota:
        """These limits with a key file entry's own in their place."""
        return replace(self, **dict(overrides)) if overrides else self


NAMES = tuple(f.name for f in fields(StorageQuota))


class QuotaExceeded(Exception):
    """A store refused to keep more for a key; the message says which limit and what to do."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def quota_value(name: str, value: Any, where: str) -> int | None:
    """One quota's value as a flag or key file gives it: a count, a size for the byte quotas, or none/unlimited."""
    if name not in NAMES:
        raise ValueError(f"{where}: unknown storage quota {name!r} (known: {', '.join(NAMES)})")
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "unlimited")):
        return None
    if isinstance(value, str) and name in BYTE_QUOTAS:
        try:
            return parse_bytes(value)
        except ValueError as e:
            raise ValueError(f"{where}: storage quota {name}: {e}") from None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: storage quota {name} must be a non-negative integer"
                         f"{' or a size (2GiB)' if name in BYTE_QUOTAS else ''}, or none, got {value!r}")
    return value


def parse_quota_flags(items: list[str]) -> StorageQuota:
    """`--storage-quota NAME=VALUE` flags over the defaults; ValueError naming the bad one."""
    values = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--storage-quota {item!r}: write NAME=VALUE, e.g. files=500 or file_bytes=2GiB")
        values[name.strip()] = quota_value(name.strip(), value.strip(), "--storage-quota")
    return StorageQuota(**values)


def parse_key_quota(value: Any, where: str) -> tuple[tuple[str, int | None], ...]:
    """A key file entry's `storage_quota:` mapping -> (name, limit) pairs; ValueError naming the bad field."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: `storage_quota` must be a mapping of quota names ({', '.join(NAMES)}) to limits")
    return tuple((str(k), quota_value(str(k), v, f"{where}: storage_quota")) for k, v in value.items())


def check_room(kind: str, held: int, held_bytes: int, add_bytes: int, count: int | None, size: int | None) -> None:
    """QuotaExceeded when one more item of `add_bytes` would take a key past `count` items or `size` bytes."""
    if count is not None and held + 1 > count:
        raise QuotaExceeded(f"this API key already keeps {held} {kind}, its limit; delete some first")
    if size is not None and held_bytes + add_bytes > size:
        raise QuotaExceeded(f"this API key's {kind} would take {held_bytes + add_bytes} bytes, over its limit of "
                            f"{size}; delete some first")
