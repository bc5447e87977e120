"""Pacing a key whose requests keep being refused, while other keys are being served.

A refused request still costs the server its work up to the refusal: receiving, parsing and validating its body,
decoding its images' headers. For a megabyte of base64 images that is milliseconds of the one Python thread that
every key's requests need (json.loads and pydantic hold the GIL throughout, so a worker thread does not help), and a
client that sends such requests back to back, on purpose or by a bug in a loop, takes that share from everyone:
a 2-token answer on another key took 3.6-4.2x its idle time beside four of them in flight (vision_abuse.md, Zen 5).

So each key has a bucket of refusals (`rate` a second, `burst` at most, as the per-key request limits count): a
4xx answer other than 401/403/429 takes one. Once it is spent, the key's next request waits, before its body is
read, until the bucket refills, but only while another key has sent a request within `ACTIVE_S` seconds: a server
with one tenant (or no keys: every request is "anonymous") never waits, nor does a client testing its error
handling alone. Waiting, not refusing: a client that fixes its requests is never answered 429, and the wait costs
the server nothing (a sleeping coroutine; the body stays in the socket's buffers). A request that waits is counted
in `lmserve:key_requests_paced_total`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmserve.server.tenants import Bucket

ACTIVE_S = 1.0  # another key counts as being served for this long after its last request arrived
# answers that took the server's work and gave nothing: bad input (400, 404, 413, 422, ...); not a missing key
# (refused before any work), nor a key's own limits (429: those already pace it)
NOT_COUNTED = (401, 403, 429)


def counts_as_refused(status: int) -> bool:
    return 400 <= status < 500 and status not in NOT_COUNTED


@dataclass
class RefusalPacer:
    """Per key: a bucket of refusals (tenants.Bucket, `burst` at most, `rate` a second, in debt down to -burst);
    when each key last sent a request. `rate` <= 0: off."""

    rate: float = 10.0
    burst: float = 20.0
    _buckets: dict[str, Bucket] = field(default_factory=dict)
    _seen: dict[str, float] = field(default_factory=dict)

    def arrive(self, key: str, now: float) -> float:
        """A request of `key` arrives: the seconds it should wait before its body is read (0: none)."""
        others = any(k != key and now - t < ACTIVE_S for k, t in self._seen.items())
        self._seen[key] = now
        if self.rate <= 0 or not others:
            return 0.0
        return self._bucket(key, now).seconds_until(1)

    def answered(self, key: str, status: int, now: float) -> None:
        """A response of `status` starts for `key`: a refusal takes one from its bucket."""
        if self.rate > 0 and counts_as_refused(status):
            bucket = self._bucket(key, now)
            bucket.level = max(bucket.level - 1, -self.burst)

    def _bucket(self, key: str, now: float) -> Bucket:
        """The key's bucket, refilled to `now` (full the first time)."""
        bucket = self._buckets.setdefault(key, Bucket(self.burst, self.burst, now, per_second=self.rate))
        bucket.refill(now)
        return bucket
