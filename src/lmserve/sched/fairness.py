"""Fairness between tenants (API key names): which waiting request to admit next, and whom to preempt for it.

With one tenant (or none: every request's tenant is "") the scheduler never calls these and stays FCFS.
With several, admission is round-robin: the tenant admitted least recently goes first, and each tenant's
own requests keep their queue order (a preempted request, at the front, first). FCFS alone would let a
tenant with 20 queued requests hold every slot for as long as its requests run; round-robin gives the next
free slot to someone else, and `fair_victim` frees one at once when a tenant holds all of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from lmserve.request import Request


def next_waiting(waiting: Iterable[Request], last_admitted: dict[str, int]) -> Request:
    """The head of the tenant admitted least recently (never admitted: first); ties go to queue order."""
    heads: dict[str, Request] = {}
    for req in waiting:
        heads.setdefault(req.tenant, req)
    # min() keeps the first of equal keys, and heads is in queue order
    return min(heads.values(), key=lambda r: last_admitted.get(r.tenant, -1))


def fair_victim(candidate: Request, running: list[Request]) -> Request | None:
    """The newest running request of the tenant holding the most slots, when it holds at least two more than the
    candidate's tenant; None otherwise.

    The margin of two makes every preemption narrow the gap between tenants, so slots never ping-pong.
    """
    counts = Counter(r.tenant for r in running)
    if not counts:
        return None
    busiest, most = max(counts.items(), key=lambda kv: kv[1])
    if busiest == candidate.tenant or most < counts[candidate.tenant] + 2:
        return None
    return next(r for r in reversed(running) if r.tenant == busiest)
