"""Fairness between tenants (API key names): in which order waiting requests join, and whom to preempt for one.

With one tenant (or none: every request's tenant is "") admission is FCFS within each priority. With several,
it is round-robin: the tenant admitted least recently goes first, and each tenant's own requests keep their
queue order (a preempted request, at the front, first). FCFS alone would let a tenant with 20 queued requests
hold every slot for as long as its requests run; round-robin gives the next free slot to someone else, and
`fair_victim` frees one at once when a tenant holds all of them. How many tokens each request then computes
is split by tokens, not slots (sched/budget.py).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Iterator

from lmserve.request import Request


def admission_order(waiting: Iterable[Request], last_admitted: dict[str, int]) -> Iterator[Request]:
    """The waiting requests in the order they would be admitted: the lowest `priority` value first; within one
    priority the head of the tenant admitted least recently (never admitted: first, in queue order).

    `last_admitted`: tenant -> number of the admission it last got; read, never changed (a copy advances).
    """
    queues: dict[int, dict[str, deque[Request]]] = {}
    for req in waiting:
        queues.setdefault(req.priority, {}).setdefault(req.tenant, deque()).append(req)
    last = dict(last_admitted)
    tick = max(last.values(), default=0)
    for priority in sorted(queues):
        tenants = queues[priority]
        while tenants:
            # min() keeps the first of equal keys: only never-admitted tenants tie, in the order they first queued
            tenant = min(tenants, key=lambda t: last.get(t, -1))
            queue = tenants[tenant]
            yield queue.popleft()
            tick += 1
            last[tenant] = tick
            if not queue:
                del tenants[tenant]


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
