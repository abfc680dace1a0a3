"""ScalingLimited means "at max and still overloaded" (idling at min or a rate limit stays quiet); the
planner restarts its history when another writer moves the replica count."""

from planner_cases import Service, pod, spec

from plimsoll.operator.scaling.autoscaler import Autoscaler, AutoscalerConfig
from plimsoll.operator.scaling.observations import PodObservation


def pods(in_flight_each: float, replicas: int) -> list[PodObservation]:
    return [pod(f"p{i}", in_flight_each) for i in range(replicas)]


def test_idle_at_min_is_not_limited_and_raises_no_warning() -> None:
    svc = Service(spec())
    plan = svc.tick(0.0, pods(0, 1))
    d = plan.decision
    assert d is not None and (d.desired_replicas, d.recommendation, d.limited_reason) == (
        1,
        0,
        "TooFewReplicas",
    )
    assert not d.scaling_limited
    assert svc.condition("ScalingLimited") == ("False", "AtMinReplicas")
    # Idle at min for a long time: still quiet on every tick.
    for t in range(5, 120, 5):
        svc.tick(float(t), pods(0.5, 1))
    assert not svc.events("ScalingLimited")


def test_at_max_and_overloaded_is_limited_and_warns_once() -> None:
    svc = Service(spec(replicas=3))
    plan = svc.tick(0.0, pods(10, 3))  # ceil(3 × 10 / 4) = 8 wanted, max 3
    d = plan.decision
    assert d is not None and (d.desired_replicas, d.recommendation) == (3, 8)
    assert d.scaling_limited and d.limited_reason == "TooManyReplicas"
    assert svc.condition("ScalingLimited") == ("True", "TooManyReplicas")
    svc.tick(5.0, pods(10, 3))
    assert len(svc.events("ScalingLimited")) == 1  # the transition warns, staying there does not


def test_a_scale_up_rate_limit_below_max_is_not_a_limit() -> None:
    svc = Service(spec(scaling={"max": 20}))
    d = svc.tick(0.0, pods(40, 1)).decision  # wants 10, the rate policy allows 5
    assert d is not None and (d.desired_replicas, d.limited_reason) == (5, "ScaleUpLimit")
    assert not d.scaling_limited and not svc.events("ScalingLimited")
    assert svc.condition("ScalingLimited") == ("False", "ScaleUpRateLimited")
    assert svc.replicas == 5


def test_a_count_written_by_someone_else_starts_a_fresh_history() -> None:
    """`kubectl scale` 1 → 4 must not be undone at once by recommendations made for 1 replica."""
    svc = Service(spec(scaling={"max": 6}, autoscaling={"scaleDownStabilizationSeconds": 600}))
    svc.tick(0.0, pods(0, 1))
    first = svc.planner.scaler
    config = AutoscalerConfig(target_per_replica=4, min_replicas=1, max_replicas=6, scale_up_window_s=0)
    stale = Autoscaler(config)
    stale.decide(0.0, 1, pods(0, 1))
    assert stale.decide(5.0, 4, pods(0, 4)).desired_replicas == 1, "what the old history would do"
    svc.spec = svc.spec.model_copy(update={"replicas": 4})  # someone else writes 4
    assert svc.tick(5.0, pods(0, 4)).decision.desired_replicas == 4  # type: ignore[union-attr]
    assert svc.planner.scaler is not first
    assert svc.tick(300.0, pods(0, 4)).decision.desired_replicas == 4  # type: ignore[union-attr]


def test_the_planners_own_write_is_not_someone_elses() -> None:
    svc = Service(spec())
    svc.tick(0.0, pods(6, 1))  # 1 replica at 6 in flight: ceil(6 / 4) = 2
    assert svc.replicas == 2
    scaler = svc.planner.scaler
    svc.spec = svc.spec.model_copy(update={"replicas": 1})  # the object still shows the old count for a tick
    svc.tick(1.0, pods(6, 1))
    assert svc.planner.scaler is scaler
