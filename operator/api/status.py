"""The LLMService status: what the operator observed, per Kubernetes API conventions.

``observedGeneration``, a ``conditions`` list (no ``phase``), replica counts, the
selector the scale subresource publishes, the endpoint, the measured capacity and
the autoscaler's last decision. The condition helper here keeps
``lastTransitionTime`` when a condition's status does not change. No I/O.
"""

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import Field

from plimsoll.operator.api.base import APIModel, FreeForm

ConditionType = Literal[
    "Ready",
    "Progressing",
    "Degraded",
    "Profiled",
    "ProfileStale",
    "ProfileDrift",
    "ScalingLimited",
    "SLOAtRisk",
    "ModelReady",
]
CONDITION_TYPES: tuple[str, ...] = ConditionType.__args__  # type: ignore[attr-defined]
ConditionStatus = Literal["True", "False", "Unknown"]
# (type, status, reason, message): one condition a writer wants set.
ConditionUpdate = tuple[ConditionType, ConditionStatus, str, str]


def now_rfc3339() -> str:
    """The current time as Kubernetes writes it (seconds, UTC, trailing Z)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Condition(APIModel):
    """One observation about the LLMService (metav1.Condition shape)."""

    type: ConditionType = Field(
        description="Ready, Progressing, Degraded, Profiled, ProfileStale, ProfileDrift, ScalingLimited, SLOAtRisk or "
        "ModelReady (an hf:// model's download)."
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", description="CamelCase reason.")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(None, ge=0, description="Spec generation this was computed from.")


class CapacityStatus(APIModel):
    """The measured (or manual) capacity per replica and what it was measured with."""

    knees: FreeForm | None = Field(
        None, description="Knees by kind (throughput, latency), as the bench report gives them."
    )
    concurrency_per_replica: int | None = Field(None, description="Target in-flight requests per replica.")
    workload: FreeForm | None = Field(None, description="The workload measured.")
    measured_at: str | None = Field(None, description="When it was measured (RFC 3339).")
    spec_hash: str | None = Field(
        None, description="Hash of model, image, engine args and GPU it was measured on."
    )
    curve: list[FreeForm] | None = Field(
        None,
        description="Per level of the sweep: concurrency, outputTokensPerS, ttftP95Ms, tpotP50Ms "
        "(what the ProfileDrift check compares each replica with).",
    )


class AutoscalerStatus(APIModel):
    """The autoscaler's last decision and how it was reached."""

    inputs: FreeForm | None = Field(None, description="Metric values and targets used.")
    formula: str | None = Field(None, description="The formula, with the numbers filled in.")
    decision: FreeForm | None = Field(None, description="Desired replicas, bounds applied, reason.")
    time: str | None = Field(None, description="When it decided (RFC 3339).")
    last_scale_up: FreeForm | None = Field(
        None,
        description="The last scale-up's timeline: each phase (metricCrossedTarget, decided, podCreated, "
        "podScheduled, containerStarted, imports, weightsLoaded, kvCacheAllocated, warmupDone, ready, "
        "firstRequestAnswered) with its time and seconds from the phase before.",
    )


class SizingStatus(APIModel):
    """How the starting replica count was worked out (``spec.expectedLoad`` ÷ the per-replica target)."""

    replicas: int | None = Field(None, description="Replicas written to spec.replicas (or used until then).")
    reason: str | None = Field(None, description="Sized, WaitingForTarget or ScaleTargetSeeded.")
    message: str | None = Field(None, description="What happened and what happens next.")
    formula: str | None = Field(None, description="The arithmetic, with the numbers filled in.")
    inputs: FreeForm | None = Field(None, description="Expected load, target and bounds used.")
    time: str | None = Field(None, description="When it was sized (RFC 3339).")


class LLMServiceStatus(APIModel):
    """Observed state of an LLMService."""

    observed_generation: int | None = Field(None, description="Spec generation last reconciled.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Current observations, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    replicas: int | None = Field(None, description="Replicas that exist (scale subresource).")
    ready_replicas: int | None = Field(None, description="Replicas that pass readiness.")
    selector: str | None = Field(None, description="Label selector of the replicas (scale subresource).")
    endpoint: str | None = Field(None, description="In-cluster URL clients use.")
    capacity: CapacityStatus | None = Field(None, description="Per-replica capacity.")
    autoscaler: AutoscalerStatus | None = Field(None, description="Last autoscaling decision.")
    sizing: SizingStatus | None = Field(None, description="Starting replica count from expectedLoad.")
    cold_start: FreeForm | None = Field(
        None, description="Measured times from a replica being needed to Ready (samplesSeconds, p95Seconds, last)."
    )
    scale_down: FreeForm | None = Field(
        None, description="The two-phase scale-down: pods being drained, why it ended, requestsCutTotal."
    )


def set_condition(
    conditions: list[dict[str, Any]],
    type: ConditionType,
    status: ConditionStatus,
    reason: str,
    message: str = "",
    observed_generation: int | None = None,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """Return ``conditions`` with ``type`` set; ``lastTransitionTime`` moves only when status changes.

    Works on the plain dicts stored in the object (camelCase keys), so the result can
    be patched back as is. The input list is not modified.
    """
    previous = next((c for c in conditions if c.get("type") == type), None)
    transition = (
        previous["lastTransitionTime"]
        if previous is not None and previous.get("status") == status and previous.get("lastTransitionTime")
        else (now or now_rfc3339())
    )
    updated = Condition(
        type=type,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=transition,
        observed_generation=observed_generation,
    ).to_api()
    others = [c for c in conditions if c.get("type") != type]
    # Keep a stable order (the declared one) so status patches do not churn.
    merged = [*others, updated]
    order = {name: i for i, name in enumerate(CONDITION_TYPES)}
    return sorted(merged, key=lambda c: order.get(str(c.get("type")), len(order)))


def get_condition(conditions: list[dict[str, Any]], type: ConditionType) -> dict[str, Any] | None:
    """The condition of ``type``, if present."""
    return next((c for c in conditions if c.get("type") == type), None)
