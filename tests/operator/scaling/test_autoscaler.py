"""The autoscaler driven through simulated metric timelines, checking every decision.

Each timeline feeds the pure decision function one observation every 5 s, the
way the handler does, and compares each decision with the value worked out in
the test from the HPA rules (not from the implementation).
"""

import json
import math
import random

import pytest
from pydantic import ValidationError

from plimsoll.operator.scaling.autoscaler import Autoscaler, AutoscalerConfig, Decision
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import PodObservation

STEP_S = 5.0


def sample(running: float, waiting: float = 0.0) -> PodSample:
    return PodSample(engine="plimsoll", running=running, waiting=waiting, kv_usage=None, ttft=None, tpot=None)


def pod(name: str, running: float, waiting: float = 0.0, ready: bool = True) -> PodObservation:
    return PodObservation(name=name, ready=ready, sample=sample(running, waiting))


def silent(name: str) -> PodObservation:
    return PodObservation(name=name, ready=True, sample=None, error="connection refused")


def unready(name: str) -> PodObservation:
    return PodObservation(name=name, ready=False, sample=None)


def config(**overrides: float) -> AutoscalerConfig:
    values: dict[str, float] = {"target_per_replica": 6, "min_replicas": 1, "max_replicas": 5}
    values.update(overrides)
    return AutoscalerConfig.model_validate(values)


def spread(total: float, replicas: int, waiting_share: float = 0.0) -> list[PodObservation]:
    """`total` in-flight shared evenly by `replicas` ready pods."""
    each = total / replicas
    return [pod(f"p{i}", each * (1 - waiting_share), each * waiting_share) for i in range(replicas)]


def test_step_up_waits_for_the_scale_up_window_then_applies_the_hpa_formula() -> None:
    scaler = Autoscaler(config())
    step_at = 100.0
    decisions: list[tuple[float, Decision]] = []
    for i in range(0, 40):
        t = i * STEP_S
        pods = [pod("a", 6), pod("b", 6)] if t < step_at else [pod("a", 6, 7), pod("b", 6, 8)]
        decisions.append((t, scaler.decide(t, 2, pods)))
    for t, d in decisions:
        if t < step_at:
            assert (d.desired_replicas, d.reason) == (2, "WithinTolerance"), (t, d)
            assert d.formula == "ceil(2 × 6 / 6) = 2"
        else:
            # 13.5 per pod against 6: the raw recommendation is 5 from the first overloaded scrape.
            assert d.recommendation == 5
            assert d.formula == "ceil(2 × 13.5 / 6) = 5"
            # Scale-up stabilisation: the MIN over (t − 30 s, t] holds 2 until the last calm
            # sample (at step − 5 s) has left the window.
            if t - 30 < step_at - STEP_S:
                assert (d.desired_replicas, d.reason) == (2, "ScaleUpStabilized"), (t, d)
            else:
                assert (d.desired_replicas, d.reason) == (5, "MetricAboveTarget"), (t, d)
    first_up = next(t for t, d in decisions if d.desired_replicas == 5)
    assert first_up == step_at - STEP_S + 30


def test_replicas_asleep_in_standby_are_woken_without_the_scale_up_window() -> None:
    # The same step with two replicas parked asleep: the first overloaded scrape wakes both (a wake is a
    # second's work that parking undoes), where a pod start waits out the 30 s window for the rest.
    scaler = Autoscaler(config())
    before = scaler.decide(95.0, 2, [pod("a", 6), pod("b", 6)], wakeable=2)
    assert (before.desired_replicas, before.reason) == (2, "WithinTolerance")  # nothing to wake for
    d = scaler.decide(100.0, 2, [pod("a", 6, 7), pod("b", 6, 8)], wakeable=2)
    assert (d.recommendation, d.stabilized, d.desired_replicas, d.reason) == (5, 2, 4, "WakeWithoutWindow")
    assert d.message == (
        "2 of 2 replica(s) asleep in standby woken at once, without the 30 s scale-up window (a wake takes "
        "about a second and parking undoes it)"
    )
    # More asleep than the load asks for: only what the recommendation wants.
    plenty = Autoscaler(config())
    plenty.decide(95.0, 2, [pod("a", 6), pod("b", 6)])
    assert plenty.decide(100.0, 2, [pod("a", 6, 3), pod("b", 6, 3)], wakeable=5).desired_replicas == 3
    # None asleep: the window holds, as above.
    held = Autoscaler(config())
    held.decide(95.0, 2, [pod("a", 6), pod("b", 6)])
    d = held.decide(100.0, 2, [pod("a", 6, 7), pod("b", 6, 8)], wakeable=0)
    assert (d.desired_replicas, d.reason) == (2, "ScaleUpStabilized")


def test_step_down_waits_for_the_scale_down_window_and_does_not_flap() -> None:
    scaler = Autoscaler(config())
    drop_at = 50.0
    replicas = 5
    changes = []
    for i in range(0, 200):
        t = i * STEP_S
        load = 30.0 if t < drop_at else 5.0
        d = scaler.decide(t, replicas, spread(load, replicas))
        if t >= drop_at and replicas == 5:
            # MAX over (t − 600 s, t]: the last high recommendation (at drop − 5 s) must leave the window.
            if t - 600 < drop_at - STEP_S:
                assert (d.desired_replicas, d.reason) == (5, "ScaleDownStabilized"), (t, d)
            else:
                assert d.desired_replicas == math.ceil(5.0 / 6), (t, d)
                assert d.formula == "ceil(5 × 1 / 6) = 1"
        if d.changed:
            changes.append((t, replicas, d.desired_replicas))
            replicas = d.desired_replicas
    assert changes == [(drop_at - STEP_S + 600, 5, 1)]


def test_ramp_scales_up_monotonically_without_overshoot() -> None:
    """Load grows 6 → 30 in-flight over 4 minutes; new replicas take 20 s to become ready."""
    scaler = Autoscaler(config())
    replicas, ready_at = 1, {0: -1.0}
    seen = []
    for i in range(0, 90):
        t = i * STEP_S
        total = min(6 + 0.1 * t, 30.0)
        ready = [k for k in range(replicas) if ready_at[k] <= t]
        pods = spread(total, len(ready)) + [unready(f"new{k}") for k in range(replicas) if ready_at[k] > t]
        d = scaler.decide(t, replicas, pods)
        assert d.desired_replicas >= replicas, (t, d)  # never scales down while load only grows
        # Never more than the load needs, plus at most the fast path's single extra replica.
        assert d.desired_replicas <= max(replicas, math.ceil(total / 6) + 1), (t, d)
        if d.changed:
            for k in range(replicas, d.desired_replicas):
                ready_at[k] = t + 20
            replicas = d.desired_replicas
        seen.append(replicas)
    assert seen == sorted(seen)
    assert seen[-1] == math.ceil(30 / 6)


def test_a_spike_shorter_than_the_window_does_not_scale() -> None:
    scaler = Autoscaler(config())
    for i in range(0, 30):
        t = i * STEP_S
        spike = 60.0 <= t < 75.0  # three scrapes, 15 s
        d = scaler.decide(t, 2, spread(60.0 if spike else 12.0, 2, waiting_share=0.5))
        assert d.desired_replicas == 2, (t, d)
        if spike:
            assert d.recommendation == 10 and d.reason == "ScaleUpStabilized"
        assert not d.fast_path


def test_noise_within_tolerance_never_changes_the_count() -> None:
    rng = random.Random(7)
    scaler = Autoscaler(config())
    for i in range(0, 200):
        t = i * STEP_S
        total = 18.0 * (1 + rng.uniform(-0.09, 0.09))  # 3 replicas × 6, ±9% < 10% tolerance
        d = scaler.decide(t, 3, spread(total, 3))
        assert (d.desired_replicas, d.reason) == (3, "WithinTolerance"), (t, d)


def test_noise_beyond_tolerance_only_scales_up_when_every_sample_in_the_window_agrees() -> None:
    rng = random.Random(11)
    scaler = Autoscaler(config())
    totals: list[tuple[float, float]] = []
    for i in range(0, 120):
        t = i * STEP_S
        total = 18.0 * (1 + rng.uniform(-0.3, 0.3))
        totals.append((t, total))
        d = scaler.decide(t, 3, spread(total, 3))
        window = [x for s, x in totals if s > t - 30]
        lowest_need = min(math.ceil(x / 6) if abs(x / 18 - 1) > 0.1 else 3 for x in window)
        expect = max(3, lowest_need) if t >= 30 else 3
        assert d.desired_replicas == expect, (t, d)
        assert d.desired_replicas >= 3  # the scale-down window (600 s) is never passed


def test_missing_metrics_count_as_target_on_scale_down_not_as_idle() -> None:
    scaler = Autoscaler(config())
    pods = [pod("a", 1), pod("b", 1), silent("c")]
    d = scaler.decide(0.0, 3, pods)
    # As idle the count would be ceil(2 / 6) = 1; at target it is ceil((1 + 1 + 6) / 6) = 2.
    assert d.recommendation == 2
    assert d.formula == "ceil(3 × 2.67 / 6) = 2"
    assert d.missing_pods == ("c",)
    assert "without metrics counted at 6" in d.message or d.reason == "ScaleDownStabilized"


def test_missing_metrics_on_scale_up_count_as_idle_and_can_cancel_it() -> None:
    scaler = Autoscaler(config())
    # Two pods at 7 (ratio 1.17 > 1.1) look overloaded; the silent third at 0 makes 4.67 < 6: no change.
    d = scaler.decide(0.0, 3, [pod("a", 7), pod("b", 7), silent("c")])
    assert d.recommendation == 3
    assert d.formula == "ceil(3 × 4.67 / 6) = 3"
    assert "direction reversed" in d.message


def test_unready_pods_count_as_idle_on_scale_up_and_are_ignored_on_scale_down() -> None:
    up = Autoscaler(config(scale_up_window_s=0))
    d = up.decide(0.0, 3, [pod("a", 6.9), pod("b", 6.9), unready("c")])
    assert d.recommendation == 3 and d.formula == "ceil(3 × 4.6 / 6) = 3"
    d = up.decide(5.0, 3, [pod("a", 15), pod("b", 15), unready("c")])
    assert d.recommendation == 5 and d.formula == "ceil(3 × 10 / 6) = 5"
    assert d.unready_pods == ("c",)
    down = Autoscaler(config(scale_down_window_s=0))
    d = down.decide(0.0, 3, [pod("a", 1), pod("b", 1), unready("c")])
    assert d.recommendation == 1 and d.formula == "ceil(2 × 1 / 6) = 1"


def test_at_max_and_still_overloaded_reports_scaling_limited() -> None:
    scaler = Autoscaler(config(scale_up_window_s=0))
    d = scaler.decide(0.0, 5, spread(60, 5))
    assert d.desired_replicas == 5
    assert d.recommendation == 10
    assert d.scaling_limited and d.limited_reason == "TooManyReplicas" and d.reason == "TooManyReplicas"
    assert "limited to max 5 while 10 are wanted" in d.message
    # Below max the same load is not limited.
    d = Autoscaler(config(scale_up_window_s=0, max_replicas=20)).decide(0.0, 5, spread(60, 5))
    assert d.desired_replicas == 10 and not d.scaling_limited


def test_fast_path_adds_a_replica_when_the_queue_stays_above_half_capacity() -> None:
    """HPA alone does not move (a silent pod cancels the scale-up); the queue rule does."""
    scaler = Autoscaler(config())
    fired = []
    for i in range(0, 20):
        t = i * STEP_S
        # waiting 6 + 6 = 12 > 0.5 × (3 × 6) = 9
        d = scaler.decide(t, 3, [pod("a", 1, 6), pod("b", 1, 6), silent("c")])
        assert d.recommendation == 3
        if d.fast_path:
            fired.append(t)
            assert (d.desired_replicas, d.reason) == (4, "QueueFastPath")
            assert "waiting 12 > 0.5 × capacity 18" in d.message
        else:
            assert d.desired_replicas == 3, (t, d)
    # First after 30 s of sustained queue, then again only after another 30 s.
    assert fired == [30.0, 60.0, 90.0]


def test_fast_path_timer_resets_when_the_queue_drains() -> None:
    scaler = Autoscaler(config())
    for i in range(0, 20):
        t = i * STEP_S
        waiting = 6 if (i % 5) != 4 else 0  # drains every 25 s
        d = scaler.decide(t, 3, [pod("a", 1, waiting), pod("b", 1, waiting), silent("c")])
        assert not d.fast_path, (t, d)


def test_no_readable_metrics_keeps_the_count_and_says_why() -> None:
    d = Autoscaler(config()).decide(0.0, 2, [silent("a"), unready("b")])
    assert (d.desired_replicas, d.reason) == (2, "NoMetrics")
    assert d.errors == ("a: connection refused",)


def test_bounds_and_zero_replicas_come_before_metrics() -> None:
    assert Autoscaler(config()).decide(0.0, 7, spread(0, 7)).desired_replicas == 5
    assert Autoscaler(config()).decide(0.0, 7, spread(0, 7)).reason == "AboveMaxReplicas"
    d = Autoscaler(config(min_replicas=2)).decide(0.0, 1, spread(0, 1))
    assert (d.desired_replicas, d.reason) == (2, "BelowMinReplicas")
    d = Autoscaler(config()).decide(0.0, 0, [])
    assert (d.desired_replicas, d.reason) == (0, "ScalingDisabled")


def test_idle_at_min_reports_too_few_replicas() -> None:
    d = Autoscaler(config(scale_down_window_s=0)).decide(0.0, 1, spread(0, 1))
    assert d.recommendation == 0 and d.desired_replicas == 1
    assert d.limited_reason == "TooFewReplicas"


def test_first_decision_neither_scales_up_nor_down() -> None:
    """A restarted operator must not act on one scrape: history starts with the current count."""
    assert Autoscaler(config()).decide(1000.0, 2, spread(60, 2)).desired_replicas == 2
    assert Autoscaler(config()).decide(1000.0, 4, spread(0, 4)).desired_replicas == 4


def test_decision_status_and_event_are_readable_json() -> None:
    scaler = Autoscaler(config(scale_up_window_s=0, target_source="profile"))
    d = scaler.decide(1_800_000_000.0, 2, [pod("a", 6, 7), pod("b", 6, 8)])
    status = json.loads(json.dumps(d.to_status()))
    assert set(status) == {"time", "formula", "inputs", "decision"}
    assert status["time"] == "2027-01-15T08:00:00Z"
    assert status["formula"] == "ceil(2 × 13.5 / 6) = 5"
    assert status["inputs"]["targetInFlightPerReplica"] == 6
    assert status["inputs"]["targetSource"] == "profile"
    assert status["inputs"]["inFlight"] == 27 and status["inputs"]["waiting"] == 15
    assert status["decision"]["desiredReplicas"] == 5 and status["decision"]["reason"] == "MetricAboveTarget"
    assert d.event_message().startswith("2 → 5: ceil(2 × 13.5 / 6) = 5")


def test_bad_config_and_clock_are_refused_with_a_reason() -> None:
    with pytest.raises(ValidationError, match=r"set scaling\.max to at least scaling\.min"):
        config(min_replicas=4, max_replicas=2)
    with pytest.raises(ValidationError, match="target_per_replica"):
        config(target_per_replica=0)
    scaler = Autoscaler(config())
    scaler.decide(10.0, 2, spread(12, 2))
    with pytest.raises(ValueError, match="time went backwards"):
        scaler.decide(5.0, 2, spread(12, 2))


def test_a_pod_that_stops_answering_for_two_minutes_does_not_shrink_the_service() -> None:
    """4 replicas at target; one pod's /metrics fails from 60 s to 180 s, then answers again."""
    scaler = Autoscaler(config())
    for i in range(0, 60):
        t = i * STEP_S
        outage = 60 <= t < 180
        pods = [pod("a", 6), pod("b", 6), pod("c", 6), silent("d") if outage else pod("d", 6)]
        d = scaler.decide(t, 4, pods)
        assert d.desired_replicas == 4, (t, d)
        if outage:
            # As the HPA does at a ratio of exactly 1: the silent pod counts as idle, (6+6+6+0)/4 = 4.5,
            # so the raw recommendation drops to 3 — and the scale-down window holds the count.
            assert d.recommendation == 3 and d.formula == "ceil(4 × 4.5 / 6) = 3"
            assert d.reason == "ScaleDownStabilized" and d.missing_pods == ("d",)
        else:
            assert (d.recommendation, d.reason) == (4, "WithinTolerance")


def test_scale_up_rate_is_limited_like_the_hpa_default_policy() -> None:
    """+4 pods or +100 % per 15 s, whichever is more, counted from the replicas at the period's start."""
    scaler = Autoscaler(config(scale_up_window_s=0, max_replicas=20))
    replicas, seen = 1, []
    for i in range(0, 8):
        t = i * STEP_S
        d = scaler.decide(t, replicas, spread(120, replicas))  # wants ceil(120 / 6) = 20
        assert d.recommendation == 20
        seen.append((t, d.desired_replicas, d.reason))
        replicas = d.desired_replicas
    assert seen == [
        (0.0, 5, "ScaleUpLimit"),  # max(1 + 4, 2 × 1)
        (5.0, 5, "ScaleUpLimit"),  # the period still starts at 1
        (10.0, 5, "ScaleUpLimit"),
        (15.0, 10, "ScaleUpLimit"),  # period start 5: max(5 + 4, 2 × 5)
        (20.0, 10, "ScaleUpLimit"),
        (25.0, 10, "ScaleUpLimit"),
        (30.0, 20, "MetricAboveTarget"),  # period start 10: 20 allowed, and 20 wanted
        (35.0, 20, "WithinTolerance"),  # 6 per pod: at target
    ]


def test_formula_numbers_keep_a_small_target_visible() -> None:
    from plimsoll.operator.scaling.formula import fmt

    assert [fmt(2.5), fmt(4.0), fmt(1 / 3), fmt(0.001), fmt(0.0045), fmt(0.0)] == [
        "2.5", "4", "0.33", "0.001", "0.0045", "0"
    ]  # fmt: skip
