"""The autoscaler's trend term: scale up for where in-flight is going, explained in the decision."""

from plimsoll.operator.scaling.autoscaler import Autoscaler, AutoscalerConfig
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import PodObservation


def pods(per_pod: float) -> list[PodObservation]:
    return [
        PodObservation(name, True, PodSample("plimsoll", per_pod, 0.0, 0.1, None, None))
        for name in ("a", "b")
    ]


def run(lookahead: float, levels: list[float]) -> list:  # type: ignore[type-arg]
    scaler = Autoscaler(
        AutoscalerConfig(
            target_per_replica=4, max_replicas=10, scale_up_window_s=0, trend_lookahead_s=lookahead
        )
    )
    return [scaler.decide(5.0 * i, 2, pods(level)) for i, level in enumerate(levels)]


def test_a_rising_load_at_target_scales_up_for_the_projection_only_with_the_trend_on() -> None:
    # 2 pods at 2, 3, 4 in flight: the level reaches the target only at the last tick.
    *_, last = run(20.0, [2.0, 3.0, 4.0])
    # Slope 0.4/s over 10 s; 8 + 0.4 × 20 = 16 in flight → ceil(16 / 4) = 4 replicas.
    assert (last.desired_replicas, last.reason) == (4, "InFlightRising")
    assert "trend: 8 + 0.4/s × 20 s = 16 in flight, ceil(16 / 4) = 4" in last.formula
    *_, level_only = run(0.0, [2.0, 3.0, 4.0])
    assert (level_only.desired_replicas, level_only.reason) == (2, "WithinTolerance")


def test_a_falling_trend_never_removes_replicas() -> None:
    *_, last = run(20.0, [4.0, 3.0, 2.0])
    assert "trend" not in last.formula and last.reason != "InFlightRising"
