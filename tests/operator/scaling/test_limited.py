"""ScalingLimited means "at max and still overloaded" (idling at min or a rate limit stays quiet); the
loop restarts its history when another writer moves the replica count."""

from plimsoll.operator.scaling.autoscaler import Autoscaler, AutoscalerConfig, PodObservation
from plimsoll.operator.scaling.autoscaler_loop import LoopState, status_patch, warn_scaling_limited
from plimsoll.operator.scaling.metrics import PodSample


def pods(in_flight_each: float, replicas: int) -> list[PodObservation]:
    sample = PodSample(
        engine="plimsoll", running=in_flight_each, waiting=0.0, kv_usage=None, ttft=None, tpot=None
    )
    return [PodObservation(name=f"p{i}", ready=True, sample=sample) for i in range(replicas)]


def scaler(**overrides: float) -> Autoscaler:
    values: dict[str, float] = {"target_per_replica": 4, "min_replicas": 1, "max_replicas": 3}
    values.update(overrides)
    return Autoscaler(AutoscalerConfig.model_validate({**values, "scale_down_window_s": 0}))


def limited(patch: dict[str, object]) -> tuple[str, str]:
    conditions = patch["conditions"]
    assert isinstance(conditions, list)
    c = next(c for c in conditions if c["type"] == "ScalingLimited")
    return c["status"], c["reason"]


def test_idle_at_min_is_not_limited_and_raises_no_warning() -> None:
    d = scaler().decide(0.0, 1, pods(0, 1))
    assert (d.desired_replicas, d.recommendation, d.limited_reason) == (1, 0, "TooFewReplicas")
    assert not d.scaling_limited
    patch = status_patch({"conditions": []}, d, 1, None)
    assert limited(patch) == ("False", "AtMinReplicas")
    assert not warn_scaling_limited(d, [])
    # Idle at min for a long time: still quiet on every tick.
    s = scaler()
    for t in range(0, 120, 5):
        assert not warn_scaling_limited(s.decide(float(t), 1, pods(0.5, 1)), patch["conditions"])  # type: ignore[arg-type]


def test_at_max_and_overloaded_is_limited_and_warns_once() -> None:
    s = scaler(scale_up_window_s=0)
    d = s.decide(0.0, 3, pods(10, 3))  # ceil(3 × 10 / 4) = 8 wanted, max 3
    assert (d.desired_replicas, d.recommendation) == (3, 8)
    assert d.scaling_limited and d.limited_reason == "TooManyReplicas"
    patch = status_patch({"conditions": []}, d, 1, None)
    assert limited(patch) == ("True", "TooManyReplicas")
    assert warn_scaling_limited(d, [])  # the transition warns
    assert not warn_scaling_limited(s.decide(5.0, 3, pods(10, 3)), patch["conditions"])  # type: ignore[arg-type]


def test_a_scale_up_rate_limit_below_max_is_not_a_limit() -> None:
    d = scaler(scale_up_window_s=0, max_replicas=20).decide(0.0, 1, pods(40, 1))  # wants 10, rate allows 5
    assert (d.desired_replicas, d.limited_reason) == (5, "ScaleUpLimit")
    assert not d.scaling_limited and not warn_scaling_limited(d, [])
    assert limited(status_patch({"conditions": []}, d, 1, None)) == ("False", "ScaleUpRateLimited")


def test_a_count_written_by_someone_else_starts_a_fresh_history() -> None:
    """The initial sizing (1 → 4) must not be undone at once by recommendations made for 1 replica."""
    config = AutoscalerConfig(target_per_replica=4, min_replicas=1, max_replicas=6, scale_down_window_s=600)
    state = LoopState()
    assert state.needs_fresh_scaler(config, 1)
    state.scaler = Autoscaler(config)
    d = state.scaler.decide(0.0, 1, pods(0, 1))
    state.saw(1, d.desired_replicas)
    assert not state.needs_fresh_scaler(config, 1)
    # The operator's initial sizing writes 4: a fresh history seeded with 4, so idle pods do not
    # shrink the service before a full scale-down window (the stale history would allow it now).
    assert Autoscaler(config).decide(0.0, 1, pods(0, 1)).desired_replicas == 1
    assert state.scaler.decide(5.0, 4, pods(0, 4)).desired_replicas == 1, "what the old history would do"
    assert state.needs_fresh_scaler(config, 4)
    fresh = Autoscaler(config)
    assert fresh.decide(5.0, 4, pods(0, 4)).desired_replicas == 4
    assert fresh.decide(300.0, 4, pods(0, 4)).desired_replicas == 4
    # The loop's own write (2 → 3) is not "someone else", even while the body still shows 2.
    state.saw(2, 3)
    assert not state.needs_fresh_scaler(config, 2) and not state.needs_fresh_scaler(config, 3)
