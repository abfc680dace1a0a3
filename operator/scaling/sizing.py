"""Initial replica sizing and the per-replica target it divides by.

What it is: the arithmetic that turns an expected load into a starting replica
count — concurrency directly, or requests per second through Little's law
(in-flight L = arrival rate λ × time in system W) — divided by the per-replica
in-flight target and clamped to ``min..max``, with the calculation as a string
for status. And the rule for where that target comes from: an explicit override
beats ``capacity.mode: Manual``'s ``concurrencyPerReplica``, which beats a
measured profile's recommendation.

What it is not: it does not read the spec or the profile report itself; the
handler passes plain numbers in.
"""

import math
from dataclasses import dataclass
from fractions import Fraction

from pydantic import BaseModel, ConfigDict, Field, model_validator

from plimsoll.operator.scaling.formula import fmt

# The condition reason while no per-replica target is known (``NoTargetError``): every
# condition that waits for one says it with this reason.
WAITING_FOR_TARGET = "WaitingForTarget"


class NoTargetError(ValueError):
    """No per-replica target is known yet; the message says what would provide one."""


@dataclass(frozen=True, slots=True)
class PerReplicaTarget:
    """In-flight requests one replica should hold, and where that number came from."""

    value: float
    source: str  # "override" | "manual" | "profile"


def resolve_target(
    *, override: float | None = None, manual: float | None = None, profile: float | None = None
) -> PerReplicaTarget:
    """Pick the target by precedence override > manual > profile; never invent one."""
    for source, value in (("override", override), ("manual", manual), ("profile", profile)):
        if value is None:
            continue
        if not value > 0:
            raise NoTargetError(f"the {source} per-replica concurrency must be positive, got {value}")
        return PerReplicaTarget(value=float(value), source=source)
    raise NoTargetError(
        "no per-replica concurrency yet: set capacity.mode: Manual with concurrencyPerReplica, "
        "or wait for the capacity profile (capacity.mode: Profile) to finish"
    )


class ExpectedLoad(BaseModel):
    """The load a service should be sized for: a concurrency, or a request rate and its mean latency."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    concurrency: float | None = Field(default=None, ge=0)
    requests_per_second: float | None = Field(default=None, gt=0)
    average_latency_s: float | None = Field(
        default=None, gt=0, description="mean end-to-end seconds per request"
    )

    @model_validator(mode="after")
    def _one_way(self) -> "ExpectedLoad":
        if self.concurrency is not None and self.requests_per_second is not None:
            raise ValueError("give expectedLoad.concurrency or expectedLoad.requestsPerSecond, not both")
        if self.concurrency is None and self.requests_per_second is None:
            raise ValueError("expectedLoad needs concurrency, or requestsPerSecond with an average latency")
        if self.requests_per_second is not None and self.average_latency_s is None:
            raise ValueError(
                "expectedLoad.requestsPerSecond needs the average request latency in seconds to apply "
                "Little's law (in-flight = rate × latency); set expectedLoad.avgLatencySeconds"
            )
        return self

    def in_flight(self) -> tuple[Fraction, str]:
        """Expected concurrent requests, and how it was obtained."""
        if self.concurrency is not None:
            return Fraction(self.concurrency), f"concurrency {fmt(self.concurrency)}"
        assert self.requests_per_second is not None and self.average_latency_s is not None
        value = Fraction(self.requests_per_second) * Fraction(self.average_latency_s)
        return value, (
            f"Little's law: {fmt(self.requests_per_second)} req/s × {fmt(self.average_latency_s)} s "
            f"= {fmt(value)} in flight"
        )


@dataclass(frozen=True, slots=True)
class SizingResult:
    """A starting replica count with its derivation."""

    replicas: int
    unclamped: int
    in_flight: float
    target: float
    formula: str
    clamped_by: str | None  # "min" | "max" | None


def initial_replicas(
    load: ExpectedLoad, target: PerReplicaTarget, min_replicas: int, max_replicas: int
) -> SizingResult:
    """``clamp(ceil(in_flight / target), min, max)``, the arithmetic spelled out."""
    if min_replicas < 0 or max_replicas < min_replicas:
        raise ValueError(
            f"replica bounds must satisfy 0 ≤ min ≤ max, got min={min_replicas} max={max_replicas}"
        )
    in_flight, how = load.in_flight()
    raw = math.ceil(in_flight / Fraction(target.value))
    replicas = min(max(raw, min_replicas), max_replicas)
    clamped_by = None if replicas == raw else ("max" if raw > max_replicas else "min")
    formula = f"{how}; ceil({fmt(in_flight)} / {fmt(target.value)} per replica ({target.source})) = {raw}"
    if clamped_by:
        formula += f"; clamped to {clamped_by} {replicas}"
    return SizingResult(
        replicas=replicas,
        unclamped=raw,
        in_flight=float(in_flight),
        target=target.value,
        formula=formula,
        clamped_by=clamped_by,
    )
