"""Prefix-affinity routing for Ray Serve: requests sharing a prompt prefix go to the same engine replica.

Each request carries a routing key (forward.routing_key: a digest of its prompt's first characters).
Replicas are ranked for a key by rendezvous hashing (highest score of hash(key, replica id) first): every
router, in every ingress replica, ranks alike without sharing any state, and when a replica dies or one
is added only the keys it held move. Ray then takes the first rank whose replica has room (fewer than
`max_ongoing_requests` in flight), so an overloaded favourite spills over to the next one; a favourite
whose cached queue is `imbalanced_threshold` requests longer than the shortest one is moved behind the
others. A request without a key (GET /v1/models, /health) is balanced by Ray's power-of-two choice.
A request naming a running replica (the `x-lmserve-replica` header: an operator reading one replica's
/metrics) goes there; naming one that is gone, it is routed as if it named none.
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

DEFAULT_IMBALANCED_THRESHOLD = 16


def rendezvous_rank(key: str, replica_ids: Sequence[str]) -> list[str]:
    """`replica_ids` in preference order for `key` (highest rendezvous score first); pure, deterministic."""
    def score(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=score, reverse=True)


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router (the `request_router_class` of the engine deployment); see the module doc."""

    def initialize_state(self, imbalanced_threshold: int = DEFAULT_IMBALANCED_THRESHOLD, **kwargs) -> None:
        """Called by Ray with the deployment's `request_router_kwargs`."""
        self.imbalanced_threshold = imbalanced_threshold

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of replicas, most preferred first: one replica per rank for a keyed request."""
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        pinned = _arg(pending_request, "replica")
        if pinned in by_id:
            return [[by_id[pinned]]]
        key = _arg(pending_request, "routing_key")
        if key is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        ranked = [by_id[rid] for rid in rendezvous_rank(key, list(by_id))]
        if self._overloaded(ranked):
            ranked = ranked[1:] + ranked[:1]
        return [[r] for r in ranked]

    def _overloaded(self, ranked: list[RunningReplica]) -> bool:
        """The favourite's cached queue is far longer than the shortest other one's (unknown counts as 0)."""
        if len(ranked) < 2:
            return False
        cache = self.replica_queue_len_cache
        lengths = [cache.get(r.replica_id) or 0 for r in ranked]
        return lengths[0] - min(lengths[1:]) > self.imbalanced_threshold


def _arg(pending_request: PendingRequest | None, name: str) -> str | None:
    """A field of the ForwardedRequest a call carries (routing_key, replica); None for any other call."""
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], name, None)
