"""What the variant planner reads each tick: each variant's target, its pods, and the demand.

What it is: pure mappings from the spec, the stored status and the tick's
observations —

- :func:`variant_targets`: per variant, the in-flight one replica carries at its
  target (the profile's ``concurrencyPerReplica`` for that variant, or Manual)
  and what that is in the unit variants are compared in. With every targeted
  variant profiled that unit is **requests per second** (``concurrency ÷ mean
  latency at that concurrency``, measured by the variant's own profile): a slow
  replica holds a request longer, so its in-flight is worth fewer requests a
  second. Otherwise it is in-flight requests (equal latency assumed, and said);
- :func:`variant_pods`: per variant, its pods as the tick saw them — serving
  (Ready, scraped), starting, silent (Ready but not answering its scrape),
  unschedulable (no node fits) and marked for removal;
- :func:`billed_cost_per_hour`: what the replicas holding a node cost now.

What it is not: the decision (``variant_planner.py``) or the optimiser
(``variant_mix.py``). No I/O.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.api.variants import VariantSpec
from plimsoll.operator.scaling.observations import Observations, PodObservation

RATE_UNIT = "requests/s"
IN_FLIGHT_UNIT = "in-flight requests"


@dataclass(frozen=True, slots=True)
class VariantTarget:
    """One variant's per-replica target, in in-flight requests and in the comparison unit."""

    name: str
    concurrency: float  # in-flight one replica carries at its target (the router's weight)
    capacity: float  # the same, in the comparison unit (requests/s when profiled)
    source: str  # profile, manual, override

    @property
    def latency_s(self) -> float:
        """Seconds a request stays (1 in in-flight units): in-flight ÷ this = demand."""
        return self.concurrency / self.capacity


def _profiled(status: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    return (((status.get("variants") or {}).get(name) or {}).get("capacity")) or {}


def variant_targets(spec: LLMServiceSpec, status: Mapping[str, Any]) -> tuple[dict[str, VariantTarget], str]:
    """Targets of the variants that have one (a profile not measured yet gives none), and the unit."""
    found: dict[str, tuple[float, float | None, str]] = {}
    override = spec.autoscaling.target_in_flight_per_replica
    for variant in spec.variants:
        capacity = _profiled(status, variant.name)
        rate = capacity.get("requestsPerSecondPerReplica")
        if override is not None:
            found[variant.name] = (override, None, "override")
        elif spec.capacity.mode == "Manual":
            manual = variant.concurrency_per_replica or spec.capacity.concurrency_per_replica
            if manual is not None:
                found[variant.name] = (float(manual), variant.requests_per_second_per_replica, "manual")
        elif capacity.get("concurrencyPerReplica"):
            found[variant.name] = (
                float(capacity["concurrencyPerReplica"]),
                float(rate) if rate else None,
                "profile",
            )
    rated = bool(found) and all(rate is not None and rate > 0 for _, rate, _ in found.values())
    unit = RATE_UNIT if rated else IN_FLIGHT_UNIT
    return (
        {
            name: VariantTarget(name, c, (rate or c) if rated else c, source)
            for name, (c, rate, source) in found.items()
        },
        unit,
    )


@dataclass
class VariantPods:
    """One variant's pods this tick."""

    serving: list[PodObservation] = field(default_factory=list)  # Ready, scraped, not marked
    starting: list[str] = field(default_factory=list)  # scheduled, not Ready yet
    silent: list[str] = field(default_factory=list)  # Ready, but the scrape failed
    unschedulable: dict[str, str] = field(default_factory=dict)  # pod -> the scheduler's message
    marked: list[str] = field(default_factory=list)  # carrying the removal mark
    scraped: list[PodObservation] = field(default_factory=list)  # every pod with a scrape (demand)
    # Pods whose Ready condition is True, answering the scrape or not, marked or not: what the
    # variant's Deployment counts as ready (status.variants.<name>.readyReplicas).
    ready: int = 0

    @property
    def existing(self) -> int:
        return (
            len(self.serving)
            + len(self.starting)
            + len(self.silent)
            + len(self.unschedulable)
            + len(self.marked)
        )

    @property
    def in_flight(self) -> float:
        return sum(p.sample.in_flight for p in self.scraped if p.sample is not None)


def variant_pods(observations: Observations, names: Sequence[str]) -> dict[str, VariantPods]:
    """Each variant's pods (pods of no listed variant are left out)."""
    pods = {name: VariantPods() for name in names}
    for pod in observations.pods:
        view = pods.get(pod.variant or "")
        if view is None or pod.terminating:
            continue
        if pod.sample is not None:
            view.scraped.append(pod)
        view.ready += pod.ready
        if pod.draining:
            view.marked.append(pod.name)
        elif pod.unschedulable is not None:
            view.unschedulable[pod.name] = pod.unschedulable
        elif not pod.ready:
            view.starting.append(pod.name)
        elif pod.sample is None:
            view.silent.append(pod.name)
        else:
            view.serving.append(pod)
    return pods


def rising_projection(points: Sequence[tuple[float, float]], lookahead_s: float) -> float | None:
    """The last value projected ``lookahead_s`` ahead along the least-squares slope, when it rises."""
    if lookahead_s <= 0 or len(points) < 3:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread <= 0:
        return None
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / spread
    return points[-1][1] + slope * lookahead_s if slope > 0 else None


def billed_cost_per_hour(variants: list[VariantSpec], pods: Mapping[str, VariantPods]) -> float:
    """What the replicas that hold a node cost per hour (a pod no node took costs nothing)."""
    total = 0.0
    for v in variants:
        view = pods.get(v.name)
        if view is not None:
            total += (
                len(view.serving) + len(view.starting) + len(view.silent) + len(view.marked)
            ) * v.cost_per_hour
    return total
