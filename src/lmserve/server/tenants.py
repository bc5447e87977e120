"""Per-key limits and identities at run time: which key a request holds, its token buckets, its role, the
salt of its prompt blocks. The keys themselves come from server/key_file.py.

Limits are token buckets whose capacity is the per-minute limit, refilled continuously (60 requests per
minute: a burst of 60, then one a second). Limits come before work: a request takes its one request from the
rate bucket before anything is parsed or tokenized (the HTTP middleware, or admission for a batch line), so a
request refused later for its size still counts. Before its prompts are tokenized, their byte bounds
(tokenizer/bounds.py) are checked against the token bucket: 429 when even the fewest tokens they can be do not
fit, else the most they can be (capped at what the bucket holds) is held while they are tokenized. At admission
the exact prompt + max_tokens (its worst case) replaces what was held, with one concurrency slot; when its
response ends, whatever the outcome, the unused tokens go back and the slot is freed. All of this runs on the
event loop thread only, so no locks.

A presented key is hashed and its digest compared in constant time with every entry's (no early exit), so
neither the key nor which entry matched shows in the timing.
"""

from __future__ import annotations

import hmac
import math
import time
from dataclasses import dataclass

from lmserve.ops.record import RequestRecord
from lmserve.server.errors import APIError
from lmserve.server.key_file import ANONYMOUS, KeySpec, key_digest
from lmserve.server.metrics import ServerMetrics

REJECT_REASONS = ("requests_per_minute", "tokens_per_minute", "concurrency", "model")


# -- limits ------------------------------------------------------------------------------------------


@dataclass
class Bucket:
    """A token bucket holding at most `capacity`, refilled at capacity per minute (or `per_second`, where given)."""

    capacity: float
    level: float  # may go below 0 when a settled request used more than it reserved
    updated: float  # time.monotonic() of the last refill
    per_second: float | None = None  # None: capacity per minute (a key's per-minute limits)

    @classmethod
    def full(cls, capacity: int | None) -> Bucket | None:
        return None if capacity is None else cls(capacity, float(capacity), time.monotonic())

    @property
    def rate(self) -> float:  # per second
        return self.capacity / 60.0 if self.per_second is None else self.per_second

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

    def __init__(self, specs: tuple[KeySpec, ...], metrics: ServerMetrics | None = None) -> None:
        self.specs = specs
        names = list(dict.fromkeys(s.name for s in specs)) or [ANONYMOUS]
        by_name = {s.name: s for s in specs} or {ANONYMOUS: KeySpec(ANONYMOUS, b"")}
        self.usage = {n: Usage(by_name[n]) for n in names}
        self.metrics = metrics
        self._open: dict[int, Reservation] = {}  # id(record) -> its reservation, until the response ends
        self._held: dict[int, Reservation] = {}  # id(record) -> tokens held while its prompts are tokenized
        if metrics is not None:
            metrics.bind_keys(metric_labels(specs) or {ANONYMOUS: ANONYMOUS}, REJECT_REASONS,
                              lambda name: self.usage[name].in_flight)

    @property
    def enabled(self) -> bool:
        return bool(self.specs)

    def identify(self, authorization: str, api_key: str = "") -> str | None:
        """The key name of an `Authorization: Bearer KEY` header or of an `x-api-key: KEY` header (what Anthropic's
        clients send), or None; constant time over every entry, both headers always checked."""
        scheme, _, given = authorization.partition(" ")
        found = None
        for key in (given if scheme.lower() == "bearer" else "", api_key):
            digest = key_digest(key)
            for spec in self.specs:
                if hmac.compare_digest(digest, spec.digest) and found is None:  # compare first: no short circuit
                    found = spec.name
        return found

    def check_model(self, name: str, model: str) -> None:
        """404 model_not_found, as OpenAI answers for a model a key has no access to (it does not say which)."""
        if not self._usage(name).spec.allows(model):
            self._rejected(name, "model")
            raise APIError(404, f"the model {model[:80]!r} does not exist or you do not have access to it",
                           param="model", code="model_not_found")

    def allows(self, name: str, model: str) -> bool:
        u = self.usage.get(name)
        return u is not None and u.spec.allows(model)

    def is_admin(self, name: str) -> bool:
        """A `role: admin` key; on a server without keys everyone is (roles come with a key file)."""
        u = self.usage.get(name)
        return not self.enabled or (u is not None and u.spec.admin)

    def lora_dirs(self, name: str) -> tuple[str, ...] | None:
        """The --lora-dir subdirectory patterns the key may load adapters from; None: every one (an admin's
        default, and everyone's on a server without keys)."""
        if not self.enabled:
            return None
        u = self.usage.get(name)
        return u.spec.adapter_dirs() if u is not None else ()

    def prefix_scope(self, name: str) -> bytes:
        """Who may share a request's prompt blocks (EngineRequest.prefix_scope): blocks are shared only between
        requests of the same scope.

        Each key's blocks are its own when keys are configured, so no key can time another's prompts; a
        `prefix_cache: shared` key, or a server without keys, uses the common pool (b""). Key names hold no ':', so
        no scope is another form of salt (a request's own, which overrides it: engine/front.py EngineFront.requests).
        """
        u = self.usage.get(name)
        if not self.enabled or (u is not None and u.spec.prefix_cache == "shared"):
            return b""
        return b"key:" + name.encode("utf-8")

    def count_prefix_hits(self, name: str, tokens: int) -> None:
        """Prompt tokens of a finished completion whose KV came from the prefix cache, by key."""
        if self.metrics is not None and tokens and name in self.usage:
            self.metrics.key_prefix_hits.labels(name).inc(tokens)

    def _usage(self, name: str) -> Usage:
        """A key name's usage; 401 for a name no longer configured (a batch job saved before the key file changed)."""
        u = self.usage.get(name)
        if u is None:
            raise APIError(401, f"the API key {name!r} is no longer accepted by this server", code="invalid_api_key")
        return u

    def take_request(self, name: str) -> None:
        """Take one request from the key's rate bucket before the request does any work, or raise 429."""
        u = self._usage(name)
        if u.requests is not None:
            u.requests.refill(time.monotonic())
            self._check_requests(u)
            u.requests.level -= 1

    def hold(self, record: RequestRecord, fewest: int, most: int) -> None:
        """Before `record`'s prompts are tokenized: 429 when its key is at its concurrency limit or even `fewest`
        tokens (prompt + max_tokens by the byte bounds) do not fit; else hold `most`, capped at what is left,
        until admit (or settle) replaces it."""
        u = self._usage(record.key_name)
        self._check_concurrency(u)
        if u.tokens is None:
            return
        u.tokens.refill(time.monotonic())
        self._check_tokens(u, fewest, by_bytes=True)
        held = max(0, min(most, math.floor(u.tokens.level)))
        u.tokens.level -= held
        self._held[id(record)] = Reservation(record.key_name, held)

    def _release_held(self, record: RequestRecord) -> None:
        r = self._held.pop(id(record), None)
        u = self.usage.get(r.name) if r is not None else None
        if u is not None and u.tokens is not None:
            u.tokens.level = min(float(u.tokens.capacity), u.tokens.level + r.tokens)

    def admit(self, record: RequestRecord, tokens: int) -> None:
        """Take `tokens` tokens and a concurrency slot for `record`'s key (and its request, unless that was taken
        before work, as every server request's is), or raise 429."""
        self._release_held(record)
        u, now = self._usage(record.key_name), time.monotonic()
        for bucket in (u.requests, u.tokens):
            if bucket is not None:
                bucket.refill(now)
        self._check_concurrency(u)
        if not record.rate_charged:
            self._check_requests(u)
        self._check_tokens(u, tokens)
        if u.requests is not None and not record.rate_charged:
            u.requests.level -= 1
        record.rate_charged = True
        if u.tokens is not None:
            u.tokens.level -= tokens
        u.in_flight += 1
        self._open[id(record)] = Reservation(record.key_name, tokens)
        if self.metrics is not None:
            self.metrics.key_requests.labels(record.key_name).inc()

    def _check_concurrency(self, u: Usage) -> None:
        s = u.spec
        if s.max_concurrent_requests is not None and u.in_flight >= s.max_concurrent_requests:
            self._refuse(s.name, "concurrency", f"{s.max_concurrent_requests} concurrent requests", 1.0)

    def _check_requests(self, u: Usage) -> None:
        s = u.spec
        if u.requests is not None and u.requests.level < 1:
            self._refuse(s.name, "requests_per_minute", f"{s.requests_per_minute} requests per minute",
                         u.requests.seconds_until(1))

    def _check_tokens(self, u: Usage, tokens: int, by_bytes: bool = False) -> None:
        """429 unless `tokens` fit; `by_bytes`: the fewest the request can need, its prompt counted by its bytes."""
        s = u.spec
        if u.tokens is None or u.tokens.level >= tokens:
            return
        least, counted = ("at least ", " by its prompt's bytes") if by_bytes else ("", "")
        needs = f"{s.tokens_per_minute} tokens per minute (this request needs {least}{tokens}{counted}: prompt + " \
                "max_tokens"
        if tokens > u.tokens.capacity:  # can never pass: OpenAI's "request too large", no point retrying
            hint = "send a shorter prompt or lower max_tokens" if by_bytes else "lower max_tokens"
            self._refuse(s.name, "tokens_per_minute", f"{needs}; {hint})", None)
        self._refuse(s.name, "tokens_per_minute", f"{needs})", u.tokens.seconds_until(tokens))

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
        self._release_held(record)  # refused between hold and admit (its size, the queue)
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


def metric_labels(specs: tuple[KeySpec, ...]) -> dict[str, str]:
    """Key name -> how /metrics names it: a key file's names as they are; plain keys `plain-1`, `plain-2`... in
    the order they were given, since a plain key's name (8 hex digits of its SHA-256) would let whoever reads
    the metrics test guesses of the key offline."""
    plain = (s.name for s in specs if s.plain)
    labels = {name: f"plain-{i}" for i, name in enumerate(plain, 1)}
    return {s.name: labels.get(s.name, s.name) for s in specs}


def duration(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it: "0s", "120ms", "1.5s", "6m0s"."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    minutes, rest = divmod(round(seconds, 3), 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{text}s" if minutes else f"{text}s"
