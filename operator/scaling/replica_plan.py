"""What the replica planner hands back for one tick: counts, pod actions, status and Events.

What it is: :class:`Plan` and its parts. A :class:`ReplicaCount` per pool says
what the count is, what it should be, why and by which formula; today there is
one pool, :data:`DEFAULT_POOL` (``spec.replicas``), and later pools (prefill and
decode, hardware variants) are more entries of the same shape. :class:`Drain`
and :class:`Undrain` are what the handler keeps true of a pod (marked for
removal, or not), stated again every tick so a restarted replica or a hand-made
``DELETE /drain`` is put back; :class:`Park` and :class:`Wake` likewise for a pod
in warm standby (``standby.py``). :class:`StatusUpdate` is the one status write of
the tick (None: nothing worth writing), :class:`PlanEvent` an Event to post.
Waking from zero is a :class:`ReplicaCount` from 0 (reason ``ScaledFromZero``):
the router releases its held requests by itself once a replica is Ready.

:class:`PlanDraft` is the plan while the rules of one tick fill it in.

What it is not: the rules that fill it (``planner.py``) or the I/O that carries
it out (``operator/handlers/replica_planning.py``).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from plimsoll.operator.api.status import ConditionUpdate
from plimsoll.operator.scaling.autoscaler import Decision

# The pool ``spec.replicas`` counts.
DEFAULT_POOL = "default"
# A hardware variant's pool (spec.variants): its Deployment's count.
VARIANT_POOL_PREFIX = "variant/"
# A replica parked asleep beside the active ones (autoscaling.standby): the router sends it nothing.
STANDBY_LABEL = "plimsoll.dev/standby"
# How a Drain shows on the pod: the router sends a pod with this label nothing new, and the
# ReplicaSet controller removes pods with the lowest deletion cost first (every other pod's is 0).
DRAINING_LABEL = "plimsoll.dev/draining"
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
DRAINING_DELETION_COST = "-1000"


def variant_pool(variant: str) -> str:
    """The pool name of one hardware variant's replicas."""
    return f"{VARIANT_POOL_PREFIX}{variant}"


def pool_variant(pool: str) -> str | None:
    """The variant a pool counts (None for the default pool)."""
    return pool.removeprefix(VARIANT_POOL_PREFIX) if pool.startswith(VARIANT_POOL_PREFIX) else None


@dataclass(frozen=True, slots=True)
class ReplicaCount:
    """One pool's replica count this tick, with its reason and formula."""

    pool: str
    current: int | None  # None: the spec sets no count yet
    desired: int
    reason: str  # CamelCase: ScaledUp, ScaledDown, ScaledToZero, ScaledFromZero, Sized, ...
    formula: str
    # Write only onto the object version that was read (the starting size never overwrites a later count).
    only_if_unchanged: bool = False

    @property
    def changed(self) -> bool:
        return self.current != self.desired


@dataclass(frozen=True, slots=True)
class Drain:
    """Keep ``pod`` marked for removal: router label, low deletion cost, ``POST /drain`` while ``/ready`` says 200."""

    pod: str
    reason: str


@dataclass(frozen=True, slots=True)
class Undrain:
    """Take the removal mark off ``pod``: ``DELETE /drain``, then the label and the deletion cost."""

    pod: str
    reason: str


@dataclass(frozen=True, slots=True)
class Park:
    """Keep ``pod`` parked in standby: label ``plimsoll.dev/standby``, asleep at ``level`` once idle."""

    pod: str
    level: int
    reason: str


@dataclass(frozen=True, slots=True)
class Wake:
    """Wake ``pod`` from standby: ``POST /wake_up``, unmark it for removal, then the label off."""

    pod: str
    reason: str


PodAction = Drain | Undrain | Park | Wake


@dataclass(frozen=True, slots=True)
class PlanEvent:
    """A Kubernetes Event on the LLMService."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class StatusUpdate:
    """Fields to merge into status and conditions to set, both onto the freshest copy."""

    fields: Mapping[str, Any]
    conditions: tuple[ConditionUpdate, ...] = ()


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything one tick decided for one LLMService."""

    time: float
    replicas: tuple[ReplicaCount, ...] = ()
    actions: tuple[PodAction, ...] = ()
    status: StatusUpdate | None = None
    events: tuple[PlanEvent, ...] = ()
    decision: Decision | None = None  # the HPA formula's verdict, when this tick asked for one
    requests_cut: float = 0.0  # requests the shutdown of removed replicas cut, newly counted this tick
    # A finished scale-up's phases (seconds each), for the operator's histogram.
    scale_up_phases: Mapping[str, float] = field(default_factory=dict)

    def changes(self) -> tuple[ReplicaCount, ...]:
        """The counts to write (those that differ from what the spec holds)."""
        return tuple(r for r in self.replicas if r.changed)

    def count(self, pool: str = DEFAULT_POOL) -> ReplicaCount | None:
        return next((r for r in self.replicas if r.pool == pool), None)

    def drained(self) -> tuple[str, ...]:
        return tuple(a.pod for a in self.actions if isinstance(a, Drain))

    def parked(self) -> tuple[str, ...]:
        return tuple(a.pod for a in self.actions if isinstance(a, Park))

    def woken(self) -> tuple[str, ...]:
        return tuple(a.pod for a in self.actions if isinstance(a, Wake))

    def undrained(self) -> tuple[str, ...]:
        return tuple(a.pod for a in self.actions if isinstance(a, Undrain))


@dataclass
class PlanDraft:
    """One tick's plan while the planner's rules fill it in; :meth:`build` freezes it."""

    now: float
    replicas: list[ReplicaCount] = field(default_factory=list)
    actions: dict[str, PodAction] = field(default_factory=dict)  # one action per pod, the last rule's
    events: list[PlanEvent] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    conditions: list[ConditionUpdate] = field(default_factory=list)
    must_write: bool = False  # something a reader acts on changed: write status this tick
    decision: Decision | None = None
    requests_cut: float = 0.0
    scale_up_phases: dict[str, float] = field(default_factory=dict)

    def count(
        self, current: int | None, desired: int, reason: str, formula: str, *, only_if_unchanged: bool = False,
        pool: str = DEFAULT_POOL,
    ) -> None:
        """A pool's count (the default pool's unless ``pool`` names another, e.g. a split service's prefill)."""
        self.replicas.append(ReplicaCount(pool, current, desired, reason, formula, only_if_unchanged))
        self.must_write = True

    def pool_count(self, pool: str, current: int | None, desired: int, reason: str, formula: str) -> None:
        """A named pool's count (a hardware variant's: :func:`variant_pool`)."""
        self.replicas.append(ReplicaCount(pool, current, desired, reason, formula))
        self.must_write = True

    def drain(self, pod: str, reason: str) -> None:
        self.actions[pod] = Drain(pod, reason)

    def undrain(self, pod: str, reason: str) -> None:
        self.actions[pod] = Undrain(pod, reason)

    def park(self, pod: str, level: int, reason: str) -> None:
        self.actions[pod] = Park(pod, level, reason)

    def wake(self, pod: str, reason: str) -> None:
        self.actions[pod] = Wake(pod, reason)

    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append(PlanEvent(type_, reason, message))

    def merge(self, key: str, value: Mapping[str, Any]) -> None:
        """Merge ``value`` into the status field ``key`` (two rules may each fill part of one block)."""
        self.fields[key] = {**(self.fields.get(key) or {}), **value}

    def build(self, write: bool) -> Plan:
        """The frozen plan; ``write`` False leaves status alone this tick."""
        return Plan(
            time=self.now,
            replicas=tuple(self.replicas),
            actions=tuple(self.actions.values()),
            status=StatusUpdate(dict(self.fields), tuple(self.conditions)) if write else None,
            events=tuple(self.events),
            decision=self.decision,
            requests_cut=self.requests_cut,
            scale_up_phases=dict(self.scale_up_phases),
        )
