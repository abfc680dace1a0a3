"""Which waiting request goes next and which running request gives way: the scheduling policy.

What it is: two small policies the scheduler consults. :class:`FCFSPolicy`
(``continuous`` and ``static``): waiting requests in arrival order, the newest
running request is the preemption victim. :class:`PriorityPolicy`
(``--scheduling-policy priority``, vLLM's semantics): lower ``priority`` runs
first, ties broken by arrival; the victim is the running request with the
*highest* priority value (newest among those). Within one priority class the
waiting request of the tenant with the fewest *virtual tokens* goes next: every
token the scheduler books for a tenant adds one to its counter, so tenants that
stay backlogged get equal shares of tokens whatever load each offers (fair
queueing over a token clock). A tenant that comes back after being idle starts
at the smallest counter among the tenants still in the system, so idle time is
not banked as credit.

What it is not: the token budget, KV allocation or the preemption mechanics
(``scheduler.py``), or per-tenant admission caps (the HTTP edge).
"""

import heapq
import itertools
from collections.abc import Iterable

from plimsoll.runtime.engine.request import Request

DEFAULT_TENANT = ""  # requests without a fairness id share one tenant


class FCFSPolicy:
    """First come, first served; preempt the newest running request."""

    is_priority = False

    def select(self, waiting: Iterable[Request]) -> Request:
        return next(iter(waiting))

    def first(self, waiting: Iterable[Request], k: int) -> list[Request]:
        return list(itertools.islice(waiting, k))

    def victim(self, running: list[Request]) -> Request:
        return running[-1]

    def running_order(self, running: list[Request]) -> None:
        """Running requests keep their admission order."""

    def should_displace(self, candidate: Request, running: list[Request]) -> Request | None:
        return None

    def on_scheduled(self, req: Request, num_tokens: int) -> None:
        """FCFS keeps no per-tenant state."""

    def on_added(self, req: Request, active: Iterable[Request]) -> None:
        """FCFS keeps no per-tenant state."""


class PriorityPolicy:
    """Lower ``priority`` first; fair share by virtual tokens across tenants within a class."""

    is_priority = True

    def __init__(self) -> None:
        self.virtual_tokens: dict[str, int] = {}

    def _tenant(self, req: Request) -> str:
        return req.fairness_id or DEFAULT_TENANT

    def _key(self, req: Request) -> tuple[int, int, float]:
        return (req.priority, self.virtual_tokens.get(self._tenant(req), 0), req.arrival_time)

    def select(self, waiting: Iterable[Request]) -> Request:
        return min(waiting, key=self._key)

    def first(self, waiting: Iterable[Request], k: int) -> list[Request]:
        """The ``k`` requests ``select`` would pick next, in that order (counters do not move meanwhile)."""
        return heapq.nsmallest(k, waiting, key=self._key)

    def victim(self, running: list[Request]) -> Request:
        # Highest priority value loses; among equals the newest arrival.
        return max(running, key=lambda r: (r.priority, r.arrival_time))

    def running_order(self, running: list[Request]) -> None:
        # When the token budget runs short, the higher classes are the ones served.
        running.sort(key=lambda r: (r.priority, r.arrival_time))

    def should_displace(self, candidate: Request, running: list[Request]) -> Request | None:
        """The running request ``candidate`` may preempt to get a slot: a strictly lower class only."""
        if not running:
            return None
        worst = self.victim(running)
        return worst if worst.priority > candidate.priority else None

    def on_scheduled(self, req: Request, num_tokens: int) -> None:
        tenant = self._tenant(req)
        self.virtual_tokens[tenant] = self.virtual_tokens.get(tenant, 0) + num_tokens

    def on_added(self, req: Request, active: Iterable[Request]) -> None:
        tenant = self._tenant(req)
        others = {self._tenant(r) for r in active if r is not req}
        if tenant in others:
            return  # still backlogged or running: its counter stands
        floor = min((self.virtual_tokens.get(t, 0) for t in others), default=0)
        self.virtual_tokens[tenant] = max(self.virtual_tokens.get(tenant, 0), floor)
        # Tenants with nothing in the system are forgotten, so the table stays as small as the load.
        for gone in [t for t in self.virtual_tokens if t not in others and t != tenant]:
            del self.virtual_tokens[gone]


SchedulingPolicy = FCFSPolicy | PriorityPolicy


def make_policy(name: str) -> SchedulingPolicy:
    return PriorityPolicy() if name == "priority" else FCFSPolicy()
