"""What the scaling logic takes from an LLMService spec: target, bounds, windows, starting size, profile hash.

What it is: pure mappings from the validated ``LLMServiceSpec`` (and the
profiled per-replica concurrency in ``status.capacity``, if any) to
:class:`AutoscalerConfig`, :class:`SizingResult` and the profile spec hash, so
the handlers never re-derive these rules.

What it is not: a reader of the cluster; the handler passes the spec and status in.
"""

from typing import Any

from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.scaling.autoscaler import AutoscalerConfig
from plimsoll.operator.scaling.pools import backlog_target, decode_signal
from plimsoll.operator.scaling.profile import profile_spec_hash
from plimsoll.operator.scaling.sizing import (
    ExpectedLoad,
    PerReplicaTarget,
    SizingResult,
    initial_replicas,
    resolve_target,
)

# Upper bound of a sized count when the spec gives no scaling.max.
UNBOUNDED = 1_000_000


def per_replica_target(spec: LLMServiceSpec, profiled: float | None) -> PerReplicaTarget:
    """Override > Manual concurrencyPerReplica > the profile's recommendation; raises NoTargetError when none."""
    manual = spec.capacity.concurrency_per_replica if spec.capacity.mode == "Manual" else None
    return resolve_target(
        override=spec.autoscaling.target_in_flight_per_replica,
        manual=manual,
        profile=profiled if spec.capacity.mode == "Profile" else None,
    )


def replica_bounds(spec: LLMServiceSpec) -> tuple[int, int]:
    """``scaling.min..max``; without a scaling block the count is fixed at the spec's replicas."""
    if spec.scaling is None:
        fixed = spec.desired_replicas()
        return fixed, fixed
    return spec.scaling.min, spec.scaling.max


def autoscaler_config(spec: LLMServiceSpec, profiled: float | None) -> AutoscalerConfig:
    """The built-in autoscaler's configuration for this service."""
    target = per_replica_target(spec, profiled)
    low, high = replica_bounds(spec)
    return AutoscalerConfig(
        target_per_replica=target.value,
        target_source=target.source,
        min_replicas=low,
        max_replicas=high,
        tolerance=spec.autoscaling.tolerance,
        scale_up_window_s=spec.autoscaling.scale_up_stabilization_seconds,
        scale_down_window_s=spec.autoscaling.scale_down_stabilization_seconds,
        trend_lookahead_s=spec.autoscaling.trend.lookahead_seconds,
        trend_window_s=spec.autoscaling.trend.window_seconds,
    )


def decode_autoscaler_config(spec: LLMServiceSpec, status: dict[str, Any]) -> AutoscalerConfig:
    """A split service's decode pool (its replicas): the decode load per pod against 1.0 (``pools.py``),
    within ``scaling``'s bounds and windows; raises NoTargetError before the decode pool has a target."""
    low, high = replica_bounds(spec)
    return AutoscalerConfig(
        target_per_replica=1.0,
        target_source=decode_signal(spec, status),
        metric_name="decode load per pod",
        min_replicas=low,
        max_replicas=max(1, high),
        tolerance=spec.autoscaling.tolerance,
        scale_up_window_s=spec.autoscaling.scale_up_stabilization_seconds,
        scale_down_window_s=spec.autoscaling.scale_down_stabilization_seconds,
        trend_lookahead_s=spec.autoscaling.trend.lookahead_seconds,
        trend_window_s=spec.autoscaling.trend.window_seconds,
    )


def prefill_autoscaler_config(spec: LLMServiceSpec) -> AutoscalerConfig:
    """A split service's prefill pool: seconds of backlog per replica against ``backlog_target``, within
    ``disaggregation.prefill``'s bounds and the service's windows (no trend: a backlog is already ahead)."""
    d = spec.disaggregation
    assert d is not None
    target, source = backlog_target(spec)
    return AutoscalerConfig(
        target_per_replica=target,
        target_source=source,
        metric_name="seconds of prompt backlog per pod",
        min_replicas=d.prefill.min,
        max_replicas=d.prefill.max,
        tolerance=spec.autoscaling.tolerance,
        scale_up_window_s=spec.autoscaling.scale_up_stabilization_seconds,
        scale_down_window_s=spec.autoscaling.scale_down_stabilization_seconds,
    )


def starting_replicas(spec: LLMServiceSpec, profiled: float | None) -> SizingResult | None:
    """Replicas for ``expectedLoad``; None when the spec sets no expected load (or no concurrency for it)."""
    load = spec.expected_load
    if load is None or (load.concurrency is None and load.requests_per_second is None):
        return None
    expected = ExpectedLoad(
        concurrency=load.concurrency,
        requests_per_second=load.requests_per_second,
        average_latency_s=load.avg_latency_seconds,
    )
    # Without a scaling block the sized count is simply the fixed count (at least one replica).
    low, high = replica_bounds(spec) if spec.scaling is not None else (1, UNBOUNDED)
    return initial_replicas(expected, per_replica_target(spec, profiled), low, high)


def spec_profile_hash(spec: LLMServiceSpec, image: str) -> str:
    """Hash of what a profile measures: model, image, engine (kind, args, batching and KV settings), GPU."""
    engine = spec.engine.model_dump(mode="json", exclude={"image", "kind"})
    if engine.get("max_new_tokens") is None:
        # Added later than the rest: unset, it leaves the hash (and so every recorded profile) as it was.
        engine.pop("max_new_tokens", None)
    gpu = {**spec.resources.gpu.model_dump(mode="json"), "nodeSelector": dict(spec.scheduling.node_selector)}
    digest: str = profile_spec_hash(
        model=spec.model.uri, image=image, engine_kind=spec.engine.kind, engine_args=engine, gpu=gpu
    )
    return digest
