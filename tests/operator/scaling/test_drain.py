"""Two-phase scale-down decisions, scale to zero and cold starts: pure, on explicit clocks."""

import math

from plimsoll.operator.scaling.autoscaler import AutoscalerConfig
from plimsoll.operator.scaling.cold_start import ColdStartClock, p95
from plimsoll.operator.scaling.drain import CutTally, DrainPlan, PodLoad, choose_victims, overloaded
from plimsoll.operator.scaling.metrics import Histogram, PodSample, parse_scrape
from plimsoll.operator.scaling.scale_to_zero import IdleClock, floored, wake_replicas


def _sample(running: float = 0, waiting: float = 0, first_tokens: float = 0) -> PodSample:
    ttft = Histogram(buckets=((1.0, first_tokens), (math.inf, first_tokens)), count=first_tokens, sum=0.0)
    return PodSample(engine="plimsoll", running=running, waiting=waiting, kv_usage=0.0, ttft=ttft, tpot=None)


def test_victims_are_the_unready_then_the_least_loaded() -> None:
    pods = [PodLoad("a", True, 3), PodLoad("b", True, 0), PodLoad("c", False, None), PodLoad("d", True, 1),
            PodLoad("e", True, None)]  # fmt: skip
    assert choose_victims(pods, 2) == ("c", "b")
    assert choose_victims(pods, 3) == ("c", "b", "d")
    assert choose_victims(pods, 5)[-1] == "e"  # unknown load counts as busy
    assert choose_victims(pods, 0) == ()


def test_drain_ends_when_empty_or_at_the_deadline() -> None:
    plan = DrainPlan(("a", "b"), from_replicas=3, to_replicas=1, started=100.0, drain_seconds=120)
    step = plan.step(110.0, {"a": 2, "b": 0, "c": 5})
    assert not step.done and dict(step.remaining) == {"a": 2}
    assert plan.step(111.0, {"a": 0, "b": 0}).reason == "Drained"
    assert plan.step(111.0, {"b": 0}).reason == "Drained"  # a pod already gone holds nothing
    late = plan.step(220.0, {"a": 1, "b": None})
    assert late.done and late.reason == "DrainTimeout" and "a (1 in flight)" in late.message
    assert "b (unknown in flight)" in late.message
    assert plan.to_status(late)["phase"] == "DrainTimeout"


def test_a_drain_in_progress_is_read_back_from_status() -> None:
    plan = DrainPlan(
        ("a", "b"), from_replicas=3, to_replicas=1, started=100.5, drain_seconds=120, purpose="ScaleDown"
    )
    again = DrainPlan.from_status(plan.to_status(), now=500.0)
    assert again == plan
    assert DrainPlan.from_status({**plan.to_status(), "startedAt": None}, now=500.0).started == 500.0  # type: ignore[union-attr]
    assert DrainPlan.from_status(plan.to_status(plan.step(101.0, {})), now=500.0) is None  # it ended
    assert DrainPlan.from_status({"phase": "Draining", "pods": ["a"]}, now=500.0) is None  # half a block


def test_the_drain_is_called_off_only_when_the_kept_replicas_are_overloaded() -> None:
    assert not overloaded([2.0], target=2, tolerance=0.1)
    assert overloaded([3.0, 2.0], target=2, tolerance=0.1)
    assert not overloaded([], target=2, tolerance=0.1)


def test_cut_counter_is_read_and_summed_once_per_removed_pod() -> None:
    gauges = (
        "# TYPE plimsoll_num_requests_running gauge\nplimsoll_num_requests_running 0\n"
        "# TYPE plimsoll_num_requests_waiting gauge\nplimsoll_num_requests_waiting 0\n"
    )
    text = (
        "# HELP plimsoll_requests_cut_by_shutdown_total x\n# TYPE plimsoll_requests_cut_by_shutdown_total counter\n"
        'plimsoll_requests_cut_by_shutdown_total{model_name="m"} 2.0\n'
    )
    assert parse_scrape(gauges + text).requests_cut == 2.0
    assert parse_scrape(gauges).requests_cut is None  # an engine without the series (vLLM)
    tally = CutTally()
    tally.watch("a")
    tally.watch("b")
    tally.observe("a", 2.0)
    tally.observe("a", None)  # an unreadable scrape keeps the last value
    tally.observe("z", 9.0)  # not a removed pod
    assert tally.settle(["a", "b"]) == 0
    assert tally.settle(["b"]) == 2.0 and tally.total == 2.0
    assert tally.settle([]) == 0 and tally.total == 2.0 and tally.watched == ()


def test_idle_clock_counts_in_flight_finished_and_held_requests_as_work() -> None:
    idle = IdleClock(last_activity=0.0)
    idle.observe(10.0, {"p": _sample(first_tokens=5)}, held=0)  # first scrape: a baseline only
    assert idle.idle_for(10.0) == 10.0
    idle.observe(20.0, {"p": _sample(first_tokens=6)}, held=0)  # a request came and went between ticks
    assert idle.idle_for(25.0) == 5.0 and "finished" in idle.last_sign
    idle.observe(30.0, {"p": _sample(running=1, first_tokens=6)}, held=0)
    assert idle.last_activity == 30.0
    idle.observe(40.0, {}, held=2)
    assert idle.last_activity == 40.0 and "held" in idle.last_sign
    assert not idle.should_scale_to_zero(49.0, idle_seconds=10)
    assert idle.should_scale_to_zero(50.0, idle_seconds=10)


def test_the_autoscaler_floor_is_one_and_a_wake_brings_min_or_one() -> None:
    config = AutoscalerConfig(target_per_replica=2, min_replicas=0, max_replicas=3)
    assert floored(config).min_replicas == 1
    assert floored(config.model_copy(update={"min_replicas": 2})).min_replicas == 2
    assert wake_replicas(0) == 1 and wake_replicas(2) == 2


def test_cold_starts_are_measured_from_need_to_ready() -> None:
    clock = ColdStartClock()
    assert not clock.seen_ready(5.0, ready=1)  # nothing was needed
    clock.needed(100.0, held_for_s=0.4)
    clock.needed(101.0)  # the first need counts
    assert not clock.seen_ready(120.0, ready=0)
    assert clock.seen_ready(130.5, ready=1)
    assert (
        clock.samples == [30.5] and clock.last is not None and clock.last["heldBeforeDecisionSeconds"] == 0.4
    )
    status = clock.to_status()
    assert status["p95Seconds"] == 30.5 and status["inProgressSince"] is None
    assert ColdStartClock.from_status(status).samples == [30.5]
    assert p95([1.0] * 19 + [50.0]) == 1.0 and p95([1.0] * 18 + [50.0, 60.0]) == 50.0
