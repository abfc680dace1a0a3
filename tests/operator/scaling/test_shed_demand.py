"""Requests refused for want of room count as demand (the planner scales up) and as SLO misses. Pure, clock-driven."""

from dataclasses import replace
from typing import Any

from planner_cases import Service, pod, sample, spec

from plimsoll.operator.scaling.attainment import AttainmentTracker
from plimsoll.operator.scaling.observations import Observations, PodObservation, RouterDemand
from plimsoll.operator.scaling.replica_plan import Plan
from plimsoll.operator.scaling.shed_demand import (
    ShedDemand,
    attainment_misses,
    demand_refusals,
    shed_recommendation,
)

ROUTER = "http://10.0.0.9:8000/hold"


def busy(
    name: str, finished: float, refused: dict[str, float] | None = None, running: float = 4
) -> PodObservation:
    """A Ready replica at its target (4 in flight): the HPA formula alone keeps the count."""
    return pod(name, sample=replace(sample(running), requests_finished=finished, refused=refused or {}))


def tick(svc: Service, now: float, pods: list[PodObservation], router: RouterDemand | None) -> Plan:
    plan = svc.planner.plan(now, Observations(pods=tuple(pods), router=router), svc.spec, svc.status)
    svc.apply(plan)
    return plan


def routed(**refused: float) -> RouterDemand:
    return RouterDemand(held=0, refused={ROUTER: refused})


def test_a_router_refusing_for_want_of_room_scales_the_service_up() -> None:
    svc = Service(spec(scaling={"max": 5}))
    tick(svc, 0.0, [busy("a", finished=100)], routed(saturated=10, invalid_request=3))
    assert svc.replicas == 1, "one tick is no interval: nothing to go by yet"
    # 1 s later: 2 refused (saturated), 2 finished, 4 in flight: each request stays 2 s, so the refused
    # ones would add 2 × 2 = 4 in flight; ceil((4 + 4) / 4) = 2. The client's own mistakes are not demand.
    plan = tick(svc, 1.0, [busy("a", finished=102)], routed(saturated=12, invalid_request=9))
    (count,) = plan.changes()
    assert (count.current, count.desired) == (1, 2)
    assert "shed: 2 req/s refused (saturated 2) × 2 s per request" in count.formula
    assert count.formula.endswith("ceil((4 + 4) / 4) = 2")
    shed = svc.status["autoscaler"]["shed"]
    assert shed["refusedPerSecondByReason"] == {"saturated": 2.0}
    assert (shed["finishedPerSecond"], shed["recommendation"]) == (2.0, 2)


def test_without_refusals_the_hpa_formula_alone_decides() -> None:
    svc = Service(spec(scaling={"max": 5}))
    tick(svc, 0.0, [busy("a", finished=100)], routed(saturated=10))
    tick(svc, 1.0, [busy("a", finished=102)], routed(saturated=10))
    assert svc.replicas == 1
    assert "shed" not in svc.status.get("autoscaler", {})


def test_behind_a_router_a_replicas_own_refusals_are_not_counted_again() -> None:
    """A replica's 429 is retried on another replica by the router; only the router's answer is the client's."""
    svc = Service(spec(scaling={"max": 5}))
    tick(svc, 0.0, [busy("a", finished=100, refused={"queue_full": 0})], routed())
    tick(svc, 1.0, [busy("a", finished=102, refused={"queue_full": 50})], routed())
    assert svc.replicas == 1


def test_without_a_router_the_replicas_refusals_count() -> None:
    svc = Service(spec(scaling={"max": 5}))
    tick(
        svc, 0.0, [busy("a", finished=100, refused={"queue_full": 0, "slo_ttft": 0, "tenant_limit": 0})], None
    )
    plan = tick(svc, 2.0, [busy("a", finished=104, refused={"queue_full": 4, "slo_ttft": 4, "tenant_limit": 40})],
                None)  # fmt: skip
    # 4 refused/s (queue_full 2, slo_ttft 2; a tenant's cap is policy, not room), 2 finished/s, 4 in flight:
    # ceil((4 + 4 × 2) / 4) = 3.
    (count,) = plan.changes()
    assert (count.current, count.desired) == (1, 3)
    assert svc.status["autoscaler"]["shed"]["refusedPerSecondByReason"] == {
        "queue_full": 2.0,
        "slo_ttft": 2.0,
    }


def test_refusals_while_nothing_finishes_ask_one_more_replica() -> None:
    svc = Service(spec(scaling={"max": 5}))
    tick(svc, 0.0, [busy("a", finished=7)], routed(hold_timeout=0))
    plan = tick(svc, 1.0, [busy("a", finished=7)], routed(hold_timeout=3))
    (count,) = plan.changes()
    assert count.desired == 2 and "none finished" in count.formula


def test_the_count_stays_within_scaling_max() -> None:
    svc = Service(spec(scaling={"max": 2}))
    tick(svc, 0.0, [busy("a", finished=0)], routed(slo_ttft=0))
    tick(svc, 1.0, [busy("a", finished=1)], routed(slo_ttft=50))
    assert svc.replicas == 2


def test_a_restarted_router_counts_from_zero() -> None:
    demand = ShedDemand(window_s=30)
    a = {"a": replace(sample(4), requests_finished=10.0)}
    demand.observe(0.0, {"router r/saturated": 100.0}, a)
    demand.observe(2.0, {"router r/saturated": 6.0}, {"a": replace(sample(4), requests_finished=14.0)})
    rate = demand.rate()
    assert rate is not None and (rate.refused_per_s, rate.finished_per_s) == (3.0, 2.0)


def test_the_window_forgets_old_refusals() -> None:
    demand = ShedDemand(window_s=10)
    s = {"a": replace(sample(4), requests_finished=0.0)}
    demand.observe(0.0, {"router r/saturated": 0.0}, s)
    demand.observe(1.0, {"router r/saturated": 20.0}, s)
    for t in range(2, 15):
        demand.observe(float(t), {"router r/saturated": 20.0}, s)
    rate = demand.rate()
    assert rate is not None and rate.refused_per_s == 0.0
    assert shed_recommendation(rate, 4, 4, 1).recommendation is None


def test_shed_requests_are_misses_in_the_attainment() -> None:
    """The router's refusals are judged and not good; a replica's slo_ttft refusal it already judged itself."""
    judged = {"a": replace(sample(), slo_good=0.0, slo_bad=0.0, slo_objectives={"ttft": 1.0},
                           refused={"slo_ttft": 0.0})}  # fmt: skip
    router = RouterDemand(held=0, refused={ROUTER: {"saturated": 0, "unauthenticated": 0}})
    tracker = AttainmentTracker({"ttft": 1.0})
    tracker.observe(0.0, judged, 1, shed=attainment_misses(router, judged))
    later = {"a": replace(judged["a"], slo_good=18.0, slo_bad=0.0)}
    router = RouterDemand(held=0, refused={ROUTER: {"saturated": 2, "unauthenticated": 30}})
    tracker.observe(60.0, later, 1, shed=attainment_misses(router, later))
    assert tracker.attainment(60.0) == 18 / 20

    # Without a router, a replica's queue_full is a miss; its slo_ttft is in its own bad count already.
    direct = {"a": replace(judged["a"], refused={"slo_ttft": 5.0, "queue_full": 2.0})}
    assert attainment_misses(None, direct) == {"replica a/queue_full": 2.0}
    assert demand_refusals(None, direct) == {"replica a/slo_ttft": 5.0, "replica a/queue_full": 2.0}


def test_a_router_without_refused_totals_still_counts_its_slo_refusals() -> None:
    old: Any = RouterDemand(held=0, shed_slo_total=4.0)
    assert attainment_misses(old, {}) == {"router/slo_ttft": 4.0}
