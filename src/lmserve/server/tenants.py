"""API keys with names and per-key limits: requests and tokens per minute, concurrency, allowed models.

The key file (`--api-key-file`) is either a YAML or JSON mapping with a `keys:` list, or one plain key per
line (the older format). Keys are kept only as SHA-256 digests: a presented key is hashed, and its digest
compared in constant time with every entry's (no early exit), so neither the key nor which entry matched
shows in the timing.

Limits are token buckets whose capacity is the per-minute limit, refilled continuously (60 requests per
minute: a burst of 60, then one a second). At admission a request takes one request and prompt + max_tokens
tokens (its worst case) and one concurrency slot; when its response ends, whatever the outcome, the unused
tokens go back and the slot is freed. All of this runs on the event loop thread only, so no locks.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmserve.errors import ConfigError
from lmserve.ops.record import RequestRecord
from lmserve.server.errors import APIError

ANONYMOUS = "anonymous"  # the key name of every request when the server takes no keys
PLAIN = "default"  # the name shared by keys given plainly (--api-key, $LMSERVE_API_KEY, a one-key-per-line file)
LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")
FIELDS = ("name", "key", "sha256", "models", *LIMITS)
REJECT_REASONS = ("requests_per_minute", "tokens_per_minute", "concurrency", "model")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # a metric label and a log field: keep it plain
_HEX_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


_EMPTY_DIGEST = key_digest("")


@dataclass(frozen=True)
class KeySpec:
    """One accepted key: its name, its digest and its limits (None: unlimited)."""

    name: str
    digest: bytes = field(repr=False)  # SHA-256 of the key (the key itself is never kept)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    models: tuple[str, ...] = ("*",)

    def allows(self, model: str) -> bool:
        return "*" in self.models or model in self.models


# -- the key file ------------------------------------------------------------------------------------


def read_key_file(path: str | Path) -> tuple[list[str], list[KeySpec]]:
    """(plain keys, named keys) from a key file; a malformed named-key file is a ConfigError naming the entry."""
    text = Path(path).read_text(encoding="utf-8")
    specs = parse_key_file(text, f"--api-key-file {path}")
    if specs is not None:
        return [], specs
    return [line.strip() for line in text.splitlines() if line.strip()], []


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
    return KeySpec(name, _entry_digest(entry, where), models=_models(entry.get("models", ["*"]), where), **limits)


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
        raise ConfigError(f"{where}: `models` must be a non-empty list of model names, or [\"*\"] for all")
    return tuple(value)


def _check_unique(specs: list[KeySpec], source: str) -> None:
    names, digests = set(), set()
    for s in specs:
        if s.name in names or s.name == ANONYMOUS:
            raise ConfigError(f"{source}: key name {s.name!r} is used twice" if s.name in names else
                              f"{source}: key name {ANONYMOUS!r} is reserved (requests on a server without keys)")
        if s.digest in digests:
            raise ConfigError(f"{source}: key {s.name!r} has the same key as an earlier entry")
        names.add(s.name)
        digests.add(s.digest)


def key_specs(plain_keys: tuple[str, ...], named: tuple[KeySpec, ...]) -> tuple[KeySpec, ...]:
    """All accepted keys: the named ones, then plain keys (unlimited, all models) under the name "default"."""
    if plain_keys and any(s.name == PLAIN for s in named):
        raise ConfigError(f"--api-key-file: key name {PLAIN!r} is taken by the plain keys of --api-key / "
                          f"$LMSERVE_API_KEY; rename the file's entry")
    return named + tuple(KeySpec(PLAIN, key_digest(k)) for k in dict.fromkeys(plain_keys) if k)


# -- limits ------------------------------------------------------------------------------------------


@dataclass
class Bucket:
    """A token bucket holding at most `capacity`, refilled at capacity per minute."""

    capacity: int
    level: float  # may go below 0 when a settled request used more than it reserved
    updated: float  # time.monotonic() of the last refill

    @classmethod
    def full(cls, capacity: int | None) -> Bucket | None:
        return None if capacity is None else cls(capacity, float(capacity), time.monotonic())

    @property
    def rate(self) -> float:  # per second
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        self.level = min(float(self.capacity), self.level + (now - self.updated) * self.rate)
        self.updated = now

    def seconds_until(self, amount: float) -> float:
        """How long until `amount` is available (after refill)."""
        return max(0.0, (amount - self.level) / self.rate)


@dataclass
class Usage:
    """One key name's live state: its buckets and the requests it has between admission and response end."""

    spec: KeySpec
    requests: Bucket | None = None
    tokens: Bucket | None = None
    in_flight: int = 0

    def __post_init__(self) -> None:
        self.requests = Bucket.full(self.spec.requests_per_minute)
        self.tokens = Bucket.full(self.spec.tokens_per_minute)


@dataclass(frozen=True)
class Reservation:
    name: str
    tokens: int  # prompt + max_tokens taken at admission


class Tenants:
    """The accepted keys (none: the server is open) and each key name's limits and usage."""

    def __init__(self, specs: tuple[KeySpec, ...], metrics: Any = None) -> None:
        self.specs = specs
        names = list(dict.fromkeys(s.name for s in specs)) or [ANONYMOUS]
        by_name = {s.name: s for s in specs} or {ANONYMOUS: KeySpec(ANONYMOUS, b"")}
        self.usage = {n: Usage(by_name[n]) for n in names}
        self.metrics = metrics
        self._open: dict[int, Reservation] = {}  # id(record) -> its reservation, until the response ends
        if metrics is not None:
            metrics.bind_keys(names, REJECT_REASONS, lambda name: self.usage[name].in_flight)

    @property
    def enabled(self) -> bool:
        return bool(self.specs)

    def identify(self, authorization: str) -> str | None:
        """The key name of an `Authorization: Bearer KEY` header, or None; constant time over every entry."""
        scheme, _, given = authorization.partition(" ")
        digest = key_digest(given if scheme.lower() == "bearer" else "")
        found = None
        for spec in self.specs:
            if hmac.compare_digest(digest, spec.digest) and found is None:  # compare first: no short circuit
                found = spec.name
        return found

    def check_model(self, name: str, model: str) -> None:
        """404 model_not_found, as OpenAI answers for a model a key has no access to (it does not say which)."""
        if not self.usage[name].spec.allows(model):
            self._rejected(name, "model")
            raise APIError(404, f"the model {model[:80]!r} does not exist or you do not have access to it",
                           param="model", code="model_not_found")

    def allows(self, name: str, model: str) -> bool:
        return self.usage[name].spec.allows(model)

    def admit(self, record: RequestRecord, tokens: int) -> None:
        """Take one request, `tokens` tokens and a concurrency slot for `record`'s key, or raise 429."""
        u, now = self.usage[record.key_name], time.monotonic()
        for bucket in (u.requests, u.tokens):
            if bucket is not None:
                bucket.refill(now)
        self._check(u, tokens)
        if u.requests is not None:
            u.requests.level -= 1
        if u.tokens is not None:
            u.tokens.level -= tokens
        u.in_flight += 1
        self._open[id(record)] = Reservation(record.key_name, tokens)
        if self.metrics is not None:
            self.metrics.key_requests.labels(record.key_name).inc()

    def _check(self, u: Usage, tokens: int) -> None:
        s = u.spec
        if s.max_concurrent_requests is not None and u.in_flight >= s.max_concurrent_requests:
            self._refuse(s.name, "concurrency", f"{s.max_concurrent_requests} concurrent requests", 1.0)
        if u.requests is not None and u.requests.level < 1:
            self._refuse(s.name, "requests_per_minute", f"{s.requests_per_minute} requests per minute",
                         u.requests.seconds_until(1))
        if u.tokens is None or u.tokens.level >= tokens:
            return
        if tokens > u.tokens.capacity:  # can never pass: OpenAI's "request too large", no point retrying
            self._refuse(s.name, "tokens_per_minute", f"{s.tokens_per_minute} tokens per minute (this request "
                         f"needs {tokens}: prompt + max_tokens; lower max_tokens)", None)
        self._refuse(s.name, "tokens_per_minute", f"{s.tokens_per_minute} tokens per minute (this request needs "
                     f"{tokens}: prompt + max_tokens)", u.tokens.seconds_until(tokens))

    def _refuse(self, name: str, reason: str, what: str, retry_after: float | None) -> None:
        self._rejected(name, reason)
        headers = {} if retry_after is None else {"Retry-After": str(max(1, math.ceil(retry_after)))}
        raise APIError(429, f"rate limit reached for key {name!r}: {what}", code="rate_limit_exceeded",
                       headers=headers, reason="rate_limited")

    def _rejected(self, name: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.key_rejections.labels(name, reason).inc()

    def settle(self, record: RequestRecord) -> None:
        """The response ended: free the slot and give back the reserved tokens that were not used."""
        r = self._open.pop(id(record), None)
        if r is None:
            return
        u = self.usage[r.name]
        u.in_flight -= 1
        prompt, completion = record.prompt_tokens, record.output_tokens
        if u.tokens is not None:
            u.tokens.refill(time.monotonic())
            u.tokens.level = min(float(u.tokens.capacity), u.tokens.level + r.tokens - prompt - completion)
        if self.metrics is not None:
            self.metrics.key_tokens.labels(r.name, "prompt").inc(prompt)
            self.metrics.key_tokens.labels(r.name, "completion").inc(completion)

    def headers(self, name: str) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the limits this key has."""
        now, out, u = time.monotonic(), [], self.usage.get(name)
        if u is None:  # an open path (/health) on a server with keys: no key, no headers
            return out
        for kind, bucket in (("requests", u.requests), ("tokens", u.tokens)):
            if bucket is None:
                continue
            bucket.refill(now)
            values = (bucket.capacity, max(0, math.floor(bucket.level)), duration(bucket.seconds_until(bucket.capacity)))
            out += [(f"x-ratelimit-{field}-{kind}".encode(), str(v).encode())
                    for field, v in zip(("limit", "remaining", "reset"), values)]
        return out


def duration(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it: "0s", "120ms", "1.5s", "6m0s"."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    minutes, rest = divmod(round(seconds, 3), 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{text}s" if minutes else f"{text}s"
