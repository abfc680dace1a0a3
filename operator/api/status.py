"""The LLMService status: what the operator observed, per Kubernetes API conventions.

``observedGeneration``, a ``conditions`` list (no ``phase``), replica counts, the
selector the scale subresource publishes, the endpoint, the measured capacity and
the autoscaler's last decision. The condition helper here keeps
``lastTransitionTime`` when a condition's status does not change. No I/O.
"""

from dataclasses import dataclass
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
    "ModelCached",
    "AdaptersReady",
    "OwnershipConflict",
]
CONDITION_TYPES: tuple[str, ...] = ConditionType.__args__  # type: ignore[attr-defined]
ConditionStatus = Literal["True", "False", "Unknown"]
# (type, status, reason, message): one condition a writer wants set.
ConditionUpdate = tuple[ConditionType, ConditionStatus, str, str]


@dataclass(frozen=True, slots=True)
class ConditionVerdict:
    """What a check concludes one condition should say; the writer adds its type and times."""

    status: ConditionStatus
    reason: str
    message: str


def now_rfc3339() -> str:
    """The current time as Kubernetes writes it (seconds, UTC, trailing Z)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Condition(APIModel):
    """One observation about the LLMService (metav1.Condition shape)."""

    type: ConditionType = Field(
        description="Ready, Progressing, Degraded, Profiled, ProfileStale, ProfileDrift, ScalingLimited, SLOAtRisk, "
        "ModelReady (an hf:// model's download), ModelCached (model.cache.prefill: every node the replicas may "
        "run on holds the model), AdaptersReady (spec.adapters loaded on every Ready replica) or "
        "OwnershipConflict (an object the LLMService would create exists and is someone else's; left untouched)."
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
    verification: FreeForm | None = Field(
        None,
        description="The hold at the recommendation after the sweep: verifiedConcurrency, sweptConcurrency, "
        "holdSeconds, attainment (the share of ~1-minute windows whose percentiles met the SLO), "
        "windowsMeasured, inconclusive (why a hold on a busy host proved nothing) and each concurrency "
        "tried (passed, attainment, why).",
    )
    disturbed_levels: list[str] | None = Field(
        None,
        description="Levels the bench measured while the host was busy, each with why (Profiled says so too).",
    )
    curve: list[FreeForm] | None = Field(
        None,
        description="Per level of the sweep: concurrency, outputTokensPerS, ttftP95Ms, tpotP50Ms "
        "(what the ProfileDrift check compares each replica with).",
    )
    measured: FreeForm | None = Field(
        None,
        description="What the profile measured: levels (each with concurrency, requests, seconds, valid), "
        "requests and seconds in total, requestsPerLevel and minSecondsPerLevel asked for, and where it "
        "ran (loadGeneratorNode, replicaNode, sameNode: the load generator shared the replica's machine).",
    )


class SLOStatus(APIModel):
    """The latency objectives in force, and where they came from."""

    ttft_p95_ms: float | None = Field(None, description="TTFT p95 objective in force, ms.")
    tpot_p50_ms: float | None = Field(None, description="TPOT p50 objective in force, ms.")
    e2e_p95_ms: float | None = Field(
        None, alias="e2eP95Ms", description="End-to-end p95 objective in force, ms."
    )
    source: str | None = Field(
        None,
        description="spec (the user's own), preset:interactive (applied because spec.slo sets none) or none.",
    )
    message: str | None = Field(None, description="What applies, in words.")


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
    token_aware: FreeForm | None = Field(
        None,
        description="The predicted-TTFT rule (with slo.ttftP95Ms): reason (PredictedTTFTAboveSLO, WithinSLO, "
        "SLOUnreachable, NoTokenSignal), formula and recommendation, and its inputs (the Ready replicas' mean "
        "backlog and predicted TTFT in seconds, the budget the SLO leaves, KV headroom, starting replicas "
        "credited by their expected Ready).",
    )
    shed: FreeForm | None = Field(
        None,
        description="While requests are refused for want of room (routers' saturated, replicas_full, slo_ttft, "
        "hold_full, hold_timeout; without a router the replicas' queue_full, slo_ttft): refused and finished "
        "requests per second, by reason, and the replicas they ask for (formula, recommendation).",
    )


class SizingStatus(APIModel):
    """How the starting replica count was worked out (``spec.expectedLoad`` ÷ the per-replica target)."""

    replicas: int | None = Field(None, description="Replicas written to spec.replicas (or used until then).")
    reason: str | None = Field(None, description="Sized, WaitingForTarget or ScaleTargetSeeded.")
    message: str | None = Field(None, description="What happened and what happens next.")
    formula: str | None = Field(None, description="The arithmetic, with the numbers filled in.")
    inputs: FreeForm | None = Field(None, description="Expected load, target and bounds used.")
    time: str | None = Field(None, description="When it was sized (RFC 3339).")


class LastProfileStatus(APIModel):
    """The last runtime profile taken on the ``plimsoll.dev/profile`` annotation, and how to fetch it."""

    pod: str | None = Field(None, description="The replica profiled.")
    kind: str | None = Field(None, description="torch (Chrome trace JSON) or py-spy (flame graph SVG).")
    seconds: float | None = Field(None, description="How long it recorded.")
    config_map: str | None = Field(None, description="ConfigMap holding it (small profiles).")
    key: str | None = Field(None, description="Its key in the ConfigMap's binaryData (gzip).")
    path: str | None = Field(None, description="Where it lies on the pod's volume (large profiles).")
    bytes: int | None = Field(None, description="Size of the stored (gzip) file.")
    time: str | None = Field(None, description="When it finished (RFC 3339).")
    fetch: str | None = Field(None, description="A command that fetches it.")
    error: str | None = Field(None, description="Why the last request gave no profile.")


class AdapterLoadFailure(APIModel):
    """A replica that refused to load an adapter, and what its engine said."""

    pod: str = Field(description="The replica pod.")
    message: str = Field(description="The engine's answer to POST /v1/load_lora_adapter.")


class AdapterStatus(APIModel):
    """Where one declared LoRA adapter is loaded."""

    name: str = Field(description="The adapter (spec.adapters[].name).")
    uri: str = Field(description="Where it was loaded from.")
    loaded_on: list[str] = Field(default_factory=list, description="Ready replica pods that serve it.")
    failures: list[AdapterLoadFailure] = Field(
        default_factory=list, description="Replicas that refused it (retried on every resync)."
    )


class KVCacheStatus(APIModel):
    """Prefix-cache hit rates over the Ready replicas since they started (spec.kvCache)."""

    queried_tokens: float = Field(description="Prompt tokens looked up in the prefix cache, all replicas.")
    primary_hit_rate: float = Field(description="Share of them found in the replicas' own KV caches.")
    tier_hit_rates: dict[str, float] = Field(
        default_factory=dict, description="Share found in each KV tier (CPU, DISK, SHARED) instead of recomputed."
    )
    hit_rate: float = Field(description="Share not recomputed: primary plus every tier.")


class PoolStatus(APIModel):
    """One pool of a split service (spec.disaggregation)."""

    replicas: int | None = Field(None, description="Replicas of the pool that exist.")
    ready_replicas: int | None = Field(None, description="Replicas of the pool that pass readiness.")
    profile: FreeForm | None = Field(
        None, description="The pool's profile: prefill promptTokensPerSecond at the TTFT SLO, decode "
        "sequencesPerReplica at the TPOT SLO (with the knee, specHash and measuredAt).",
    )  # fmt: skip
    autoscaler: FreeForm | None = Field(
        None, description="The pool's scaling signal, its target, the formula and the decision."
    )


class DisaggregationStatus(APIModel):
    """What a split service runs, and why (spec.disaggregation)."""

    runs: str = Field(description="split (prefill and decode pools behind the router).")
    ratio: str | None = Field(None, description="The pools now, as PREFILL P : DECODE D.")
    reasons: list[str] = Field(default_factory=list, description="Why: the prediction's reasons, or what it lacks.")
    prediction: FreeForm | None = Field(
        None, description="From both pools' profiles and spec.disaggregation.linkBandwidth: goodput per replica "
        "aggregated and split at each ratio, and the verdict (plimsoll.disaggregation).",
    )  # fmt: skip
    prefill: PoolStatus | None = Field(None, description="The prefill pool.")
    decode: PoolStatus | None = Field(None, description="The decode pool (the service's replicas).")
class VariantCapacityStatus(CapacityStatus):
    """One variant's measured capacity, with the request rate one replica carries at its target."""

    requests_per_second_per_replica: float | None = Field(
        None,
        description="Requests per second one replica finishes at concurrencyPerReplica (concurrency ÷ the "
        "mean end-to-end latency measured there): the unit variants are compared in.",
    )


class VariantStatus(APIModel):
    """What one hardware variant measured, runs and costs."""

    capacity: VariantCapacityStatus | None = Field(None, description="This variant's capacity profile.")
    profile: FreeForm | None = Field(
        None, description="Where this variant's profiling stands: reason and message (Profiled sums them up)."
    )
    replicas: int | None = Field(None, description="Replicas the planner set (its Deployment's spec.replicas).")
    ready_replicas: int | None = Field(None, description="Of them, Ready.")
    weight: float | None = Field(
        None,
        description="In-flight requests one replica carries at its target: the router weighs this variant's "
        "replicas by it.",
    )
    rate: float | None = Field(
        None,
        description="Requests/s one replica finishes at that target (in-flight requests when not profiled): "
        "the router sends this variant's replicas traffic in proportion to it.",
    )
    cost_per_hour: float | None = Field(None, description="What its running replicas cost per hour now.")
    available: bool | None = Field(None, description="False while left out of the mix (see reason).")
    reason: str | None = Field(None, description="Why it is unavailable, or what it is waiting for.")


class CostStatus(APIModel):
    """What the service costs (spec.variants[].costPerHour of the replicas running)."""

    per_hour: float | None = Field(None, description="Cost per hour of the replicas running now.")
    per_1k_good_requests: float | None = Field(
        None,
        description="Cost spent over the window per 1000 requests that met every spec.slo bound (needs "
        "spec.slo, and replicas that judge requests: plimsoll's).",
    )
    good_requests: float | None = Field(None, description="Good requests in the window.")
    spent: float | None = Field(None, description="Cost spent over the window.")
    window_seconds: float | None = Field(None, description="The window (the last hour, or since tracking began).")
    time: str | None = Field(None, description="When it was computed (RFC 3339).")


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
    slo: SLOStatus | None = Field(None, description="The latency objectives in force and their source.")
    autoscaler: AutoscalerStatus | None = Field(None, description="Last autoscaling decision.")
    sizing: SizingStatus | None = Field(None, description="Starting replica count from expectedLoad.")
    last_profile: LastProfileStatus | None = Field(
        None, description="The last runtime profile (plimsoll.dev/profile annotation) and how to fetch it."
    )
    cold_start: FreeForm | None = Field(
        None,
        description="Measured times from a replica being needed to Ready (samplesSeconds, p95Seconds, last).",
    )
    adapters: list[AdapterStatus] | None = Field(
        None, description="Each declared LoRA adapter and the Ready replicas it is loaded on."
    )
    scale_down: FreeForm | None = Field(
        None, description="The two-phase scale-down: pods being drained, why it ended, requestsCutTotal."
    )
    kv_cache: KVCacheStatus | None = Field(None, description="Prefix-cache hit rates per KV tier.")
    disaggregation: DisaggregationStatus | None = Field(
        None, description="Prefill and decode pools: which layout runs and why, each pool's profile and scaling."
    )
    variants: dict[str, VariantStatus] | None = Field(
        None, description="Per hardware variant (spec.variants): capacity, replicas, router weight, cost."
    )
    mix: FreeForm | None = Field(
        None,
        description="The replica planner's last variant mix: demand, each variant's capacity and cost, the "
        "chosen mix, the runner-up and why not, and what is being carried out.",
    )
    cost: CostStatus | None = Field(None, description="Cost per hour now and per 1000 good requests.")
    standby: FreeForm | None = Field(
        None,
        description="Replicas parked asleep (autoscaling.standby): replicas wanted, level, parked and asleep now, "
        "their pods, the host memory they hold (memoryBytes) and the last wake's seconds to Ready.",
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
    previous = get_condition(conditions, type)
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
