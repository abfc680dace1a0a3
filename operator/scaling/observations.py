"""What the replica planner is told each tick: the pods as the handler saw them, the router's queue.

What it is: :class:`PodObservation` (one pod: Ready or not, its parsed scrape or
why there is none, whether it carries the draining mark, whether it is on its
way out) and :class:`Observations` (every pod of the service, the pod objects
for the scale-up timeline, the router's held requests, the last minute's SLO
attainment, the object's generation and creation time). New signals (tokens,
per-pool pods) are new fields here, read by the planner: the token-aware load
rides on each pod's :class:`PodSample`, parked standby pods on ``standby``; hardware
variants add each pod's variant, whether it can be scheduled, each variant's count and
the cost window.

What it is not: a reader of the cluster. ``operator/handlers/replica_planning.py``
lists the pods, scrapes them and asks the router; nothing here does I/O.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from plimsoll.operator.scaling.metrics import PodSample


@dataclass(frozen=True, slots=True)
class PodObservation:
    """What the handler saw of one pod: readiness and its parsed scrape (None when unreadable)."""

    name: str
    ready: bool
    sample: PodSample | None
    error: str | None = None  # why the scrape could not be read, for the trace
    draining: bool = False  # carries the plimsoll.dev/draining label (marked for removal)
    terminating: bool = False  # being deleted, or Failed/Succeeded: no longer counted for scaling
    variant: str | None = None  # its plimsoll.dev/variant label (spec.variants)
    unschedulable: str | None = None  # the scheduler's message while no node fits it
    standby: bool = False  # carries the plimsoll.dev/standby label: parked (asleep, or being put to sleep)
    created_at: float | None = None  # metadata.creationTimestamp: how long a starting pod has been starting


@dataclass(frozen=True, slots=True)
class CostWindow:
    """What the replicas cost over the attainment tracker's window, and the good requests in it."""

    per_hour: float  # now
    spent: float | None  # over the window
    good_requests: float | None  # over the window
    window_s: float | None


@dataclass(frozen=True, slots=True)
class RouterDemand:
    """The routers' ``GET /hold``: requests held while no replica is Ready (summed over the router pods), the
    oldest one's wait, and what each router refused."""

    held: int
    oldest_held_s: float | None = None
    # Requests the router refused because every replica would miss their TTFT bound (cumulative).
    shed_slo_total: float | None = None
    # Requests each router answered itself, by reason (cumulative): router -> reason -> count. Every
    # router pod is asked: with router.replicas > 1 each sees only its share of the clients.
    refused: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # Parked (standby) pods a router woke itself because every awake replica was past its target:
    # pod -> seconds since (the shortest over the routers). The planner takes them in as a scale-up.
    woken: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Observations:
    """One tick's evidence for one LLMService."""

    pods: tuple[PodObservation, ...] = ()
    # The pod objects as listed (the scale-up timeline reads their timestamps).
    pod_objects: tuple[Mapping[str, Any], ...] = ()
    router: RouterDemand | None = None  # None: no router asked (or none answered)
    attainment: float | None = None  # the last minute's share of requests within every SLO bound
    generation: int | None = None  # metadata.generation, for the conditions' observedGeneration
    created_at: float | None = None  # metadata.creationTimestamp: the first cold start counts from it
    # A split service's prefill pool (spec.disaggregation); ``pods`` are then its decode pool.
    prefill_pods: tuple[PodObservation, ...] = ()
    # spec.variants: each variant Deployment's spec.replicas, and what the replicas cost.
    variant_replicas: Mapping[str, int] = field(default_factory=dict)
    cost: CostWindow | None = None

    @property
    def counted(self) -> tuple[PodObservation, ...]:
        """The pods the HPA formula counts: not being deleted, not finished."""
        return tuple(p for p in self.pods if not p.terminating)

    def ready_samples(self) -> dict[str, PodSample]:
        """Scrapes of the counted Ready pods, by pod name."""
        return {p.name: p.sample for p in self.counted if p.ready and p.sample is not None}

    @property
    def held(self) -> int:
        return self.router.held if self.router is not None else 0

    @property
    def parked(self) -> tuple[PodObservation, ...]:
        """Counted pods parked in standby (``autoscaling.standby``): they serve nothing."""
        return tuple(p for p in self.counted if p.standby)

    def active(self) -> "Observations":
        """These observations without the parked pods: what every rule but the standby one reads."""
        if not any(p.standby for p in self.pods):
            return self
        return replace(self, pods=tuple(p for p in self.pods if not p.standby or p.terminating))
