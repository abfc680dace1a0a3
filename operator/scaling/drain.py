"""The two-phase scale-down: which replicas go, when they have drained, and what the shutdown cut.

What it is: pure decisions for the built-in autoscaler's scale-down (and the
last replica's way to zero). Phase one, :func:`choose_victims` picks the
replicas to remove — unready ones first (they serve nothing, and the ReplicaSet
controller removes unready pods first anyway), then the fewest in flight —
and the handler marks them (label ``plimsoll.dev/draining``, so the router sends
them nothing new; ``POST /drain``, so their readiness drops; and a low
``controller.kubernetes.io/pod-deletion-cost``, so the ReplicaSet controller
deletes exactly them). :class:`DrainPlan` then waits, tick by tick, until each
has nothing in flight or ``scaling.drainSeconds`` has passed; phase two lowers
the count. :func:`overloaded` says when the load came back so much that the
drain should be called off. A drain in progress is written to
``status.scaleDown`` and read back from it (:meth:`DrainPlan.from_status`), so an
operator restart goes on with it instead of leaving its pods marked.
:class:`CutTally` sums, over removed pods, the replicas' own
``plimsoll_requests_cut_by_shutdown_total`` as last seen.

What it is not: I/O (the handler patches pods and scrapes them) or the choice
of how many replicas to run (the autoscaler's); the planner (``planner.py``)
strings these steps together.
"""

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.scaling.timestamps import parse_time, rfc3339


@dataclass(frozen=True, slots=True)
class PodLoad:
    """What phase one knows of a replica: is it Ready, and how much does it hold (None: unknown)."""

    name: str
    ready: bool
    in_flight: float | None


def choose_victims(pods: Iterable[PodLoad], count: int) -> tuple[str, ...]:
    """The ``count`` replicas to remove: unready first, then fewest in flight (unknown counts as busy), then name."""
    ranked = sorted(
        pods,
        key=lambda p: (p.ready, math.inf if p.in_flight is None else p.in_flight, p.name),
    )
    return tuple(p.name for p in ranked[: max(0, count)])


@dataclass(frozen=True, slots=True)
class DrainStep:
    done: bool
    reason: str  # Draining, Drained, DrainTimeout, PodsGone
    message: str
    remaining: Mapping[str, float]


@dataclass
class DrainPlan:
    """One scale-down in progress: these pods are draining so the count can go to ``to_replicas``."""

    pods: tuple[str, ...]
    from_replicas: int
    to_replicas: int
    started: float
    drain_seconds: float
    purpose: str = "ScaleDown"  # or ScaleToZero

    def step(self, now: float, in_flight: Mapping[str, float | None]) -> DrainStep:
        """``in_flight`` by pod name for the pods still listed (a missing pod is gone; None: unreadable)."""
        remaining: dict[str, float] = {}
        for pod in self.pods:
            if pod not in in_flight:
                continue  # already gone: nothing left on it to cut
            n = in_flight[pod]
            if n is None or n > 0:
                remaining[pod] = math.nan if n is None else n
        waited = now - self.started
        if not remaining:
            return DrainStep(True, "Drained", f"{', '.join(self.pods)} drained in {waited:.1f} s", remaining)
        if waited >= self.drain_seconds:
            busy = ", ".join(f"{p} ({'unknown' if math.isnan(n) else f'{n:g}'} in flight)"
                             for p, n in remaining.items())  # fmt: skip
            return DrainStep(
                True, "DrainTimeout",
                f"scaling.drainSeconds {self.drain_seconds:g} s passed with {busy}; removing them anyway "
                "(each replica still drains on SIGTERM up to its own deadline)", remaining,
            )  # fmt: skip
        return DrainStep(False, "Draining", f"waiting for {', '.join(remaining)} to finish", remaining)

    def to_status(self, step: DrainStep | None = None) -> dict[str, object]:
        return {
            "phase": "Draining" if step is None or not step.done else step.reason,
            "purpose": self.purpose,
            "pods": list(self.pods),
            "fromReplicas": self.from_replicas,
            "toReplicas": self.to_replicas,
            "drainSeconds": self.drain_seconds,
            "startedAt": rfc3339(self.started),
            "message": None if step is None else step.message,
        }

    @classmethod
    def from_status(cls, block: Mapping[str, Any] | None, now: float) -> "DrainPlan | None":
        """The drain ``status.scaleDown`` says is in progress (None when none is); no start time: ``now``."""
        block = block or {}
        pods = block.get("pods")
        if block.get("phase") != "Draining" or not pods:
            return None
        try:
            return cls(
                pods=tuple(str(p) for p in pods),
                from_replicas=int(block["fromReplicas"]),
                to_replicas=int(block["toReplicas"]),
                started=parse_time(block.get("startedAt")) or now,
                drain_seconds=float(block["drainSeconds"]),
                purpose=str(block.get("purpose") or "ScaleDown"),
            )
        except (KeyError, TypeError, ValueError):
            return None  # written by hand or by an older operator: start over rather than guess


def overloaded(in_flight_of_kept: Iterable[float], target: float, tolerance: float) -> bool:
    """The replicas that stay hold more than the target (beyond tolerance): call the drain off."""
    values = list(in_flight_of_kept)
    if not values:
        return False
    return sum(values) / len(values) > target * (1 + tolerance)


@dataclass
class CutTally:
    """Requests cut by scale-downs: each removed pod's last seen counter, added once the pod is gone."""

    total: float = 0.0
    _last: dict[str, float] = field(default_factory=dict)

    def watch(self, pod: str) -> None:
        self._last.setdefault(pod, 0.0)

    def observe(self, pod: str, value: float | None) -> None:
        if pod in self._last and value is not None:
            self._last[pod] = max(self._last[pod], value)

    @property
    def watched(self) -> tuple[str, ...]:
        return tuple(self._last)

    def settle(self, present: Iterable[str]) -> float:
        """Add the counts of watched pods that are gone; return what was added."""
        still = set(present)
        added = 0.0
        for pod in [p for p in self._last if p not in still]:
            added += self._last.pop(pod)
        self.total += added
        return added
