"""Warm standby through the planner: parked replicas woken for a scale-up or a request at zero, the surplus parked."""

from typing import Any

import pytest
from planner_cases import Service, pod, spec
from pydantic import ValidationError

from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import Observations, PodObservation, RouterDemand
from plimsoll.operator.scaling.replica_plan import Park, Wake


def asleep(name: str, level: int = 1, rss: float = 300e6, **kw: Any) -> PodObservation:
    """A parked pod that sleeps (not Ready: /ready answers 503 asleep)."""
    sample = PodSample(engine="plimsoll", running=0, waiting=0, kv_usage=0.0, ttft=None, tpot=None,
                       sleep_level=level, resident_bytes=rss)  # fmt: skip
    return PodObservation(name, ready=False, sample=sample, standby=True, **kw)


def standby_spec(**over: Any) -> Any:
    return spec(**{"autoscaling": {"standby": {"replicas": 2}}, "scaling": {"min": 1, "max": 4}, **over})


def test_a_scale_up_wakes_parked_replicas_before_any_pod_starts() -> None:
    svc = Service(standby_spec())
    plan = svc.tick(0.0, [pod("a", 10), asleep("p1"), asleep("p2")])  # ceil(10 / 4) = 3
    assert plan.changes()[0].desired == 3
    assert set(plan.woken()) == {"p1", "p2"}
    assert "woken from sleep level 1 instead of started" in svc.events("WokenFromStandby")[0]
    # The parked pods served nothing: the HPA formula counted only "a".
    assert svc.status["autoscaler"]["inputs"]["readyPods"] == 1


def test_pods_started_to_refill_the_pool_are_parked_and_the_parked_stay_asleep() -> None:
    svc = Service(standby_spec(replicas=1))
    new = [pod(n, ready=False, sample=None) for n in ("n1", "n2")]  # the Deployment's spec.replicas + 2
    plan = svc.tick(0.0, [pod("a", 2), *new])
    assert set(plan.parked()) == {"n1", "n2"} and not plan.changes()
    assert all(a.level == 1 for a in plan.actions if isinstance(a, Park))
    again = svc.tick(1.0, [pod("a", 2), asleep("n1"), asleep("n2")])
    assert set(again.parked()) == {"n1", "n2"}  # stated again every tick: a restarted one sleeps again
    standby = svc.status["standby"]
    assert (standby["parked"], standby["asleep"], standby["memoryBytes"]) == (2, 2, 600_000_000)


def test_the_first_request_at_zero_wakes_a_parked_replica_and_the_wake_is_timed() -> None:
    svc = Service(
        standby_spec(replicas=0, scaling={"min": 0, "max": 4, "drainSeconds": 60}, router={"enabled": True})
    )
    plan = svc.tick(0.0, [asleep("p1"), asleep("p2")], held=2)
    assert plan.changes()[0].reason == "ScaledFromZero" and len(plan.woken()) == 1
    woken = plan.woken()[0]
    other = "p2" if woken == "p1" else "p1"
    # A second later it is awake, unlabelled and Ready: the wake took 1 s, and the cold start too.
    svc.tick(1.0, [pod(woken, 0), asleep(other)], held=2)
    assert svc.status["standby"]["lastWakeSeconds"] == 1.0
    assert svc.status["coldStart"]["samplesSeconds"][-1] == pytest.approx(1.0, abs=0.6)


def test_a_scale_down_parks_the_drained_replicas_instead_of_leaving_them_to_deletion() -> None:
    svc = Service(standby_spec(replicas=2))
    plan = svc.tick(0.0, [pod("a", 0), pod("b", 1), asleep("p1"), asleep("p2")])  # ceil(2 × 0.5 / 4) = 1
    assert plan.drained() == ("a",)
    marked = pod("a", 0, draining=True, ready=False)
    done = svc.tick(1.0, [marked, pod("b", 1), asleep("p1"), asleep("p2")])
    assert done.changes()[0].desired == 1
    assert "parking exactly those pods in standby" in svc.events("ScaledDown")[0]
    assert "a" in done.parked()  # parked asleep; the Deployment (1 + 2) deletes a parked pod
    assert all(not isinstance(a, Wake) for a in done.actions)


def test_a_woken_replica_counts_as_active_at_once() -> None:
    svc = Service(standby_spec(replicas=1))
    svc.tick(0.0, [pod("a", 10), asleep("p1"), asleep("p2")])  # 1 → 3, both woken
    # The handler took the labels off: both serve; nothing more is woken or parked.
    plan = svc.tick(1.0, [pod("a", 4), pod("p1", 4), pod("p2", 4)])
    assert not plan.woken() and not plan.parked()


def test_standby_needs_the_builtin_autoscaler_and_single_pod_replicas() -> None:
    base = {"model": {"uri": "embedded://smollm2-135m"}, "scaling": {"min": 1, "max": 2}}
    with pytest.raises(ValidationError, match=r"standby needs autoscaling\.mode builtin"):
        LLMServiceSpec.model_validate({**base, "autoscaling": {"mode": "hpa", "standby": {"replicas": 1}}})
    with pytest.raises(ValidationError, match=r"resources\.nodes > 1"):
        LLMServiceSpec.model_validate({**base, "model": {"uri": "hf://org/model"}, "engine": {"kind": "vllm"},
                                       "autoscaling": {"standby": {"replicas": 1}},
                                       "resources": {"nodes": 2, "gpu": {"count": 1}}})  # fmt: skip
    with pytest.raises(ValidationError, match=r"engine\.kind sglang does not serve"):
        LLMServiceSpec.model_validate({**base, "model": {"uri": "hf://org/model"}, "engine": {"kind": "sglang"},
                                       "autoscaling": {"standby": {"replicas": 1}}})  # fmt: skip


def test_a_wake_does_not_wait_for_the_scale_up_window_a_pod_start_does() -> None:
    window = {"scaleUpStabilizationSeconds": 30}
    svc = Service(standby_spec(replicas=1, autoscaling={"standby": {"replicas": 2}, **window}))
    svc.tick(0.0, [pod("a", 2), asleep("p1"), asleep("p2")])
    plan = svc.tick(5.0, [pod("a", 10), asleep("p1"), asleep("p2")])  # ceil(10 / 4) = 3, the window says 1
    assert plan.changes()[0].desired == 3 and set(plan.woken()) == {"p1", "p2"}
    decision = svc.status["autoscaler"]["decision"]
    assert (decision["reason"], decision["stabilizedRecommendation"]) == ("WakeWithoutWindow", 1)
    # The same step without standby: no pod starts until the load has held for the window.
    cold = Service(spec(replicas=1, scaling={"min": 1, "max": 4}, autoscaling=window))
    cold.tick(0.0, [pod("a", 2)])
    held = cold.tick(5.0, [pod("a", 10)])
    assert not held.changes() and held.decision is not None and held.decision.reason == "ScaleUpStabilized"


def woken_by_router(name: str, running: float) -> PodObservation:
    """A parked pod a router woke: awake and serving, still labelled, its pod not yet Ready again."""
    sample = PodSample(engine="plimsoll", running=running, waiting=0, kv_usage=0.0, ttft=None, tpot=None)
    return PodObservation(name, ready=False, sample=sample, standby=True)


def test_parked_replicas_a_router_woke_are_taken_in_as_a_scale_up() -> None:
    svc = Service(standby_spec(replicas=1, router={"enabled": True}))
    svc.tick(0.0, [pod("a", 2), asleep("p1"), asleep("p2")], held=0)  # 2 in flight, target 4: one replica
    # Every awake replica was past its target at the router: it woke p2 (not p1, which sleeps on).
    router = RouterDemand(held=0, woken={"p2": 0.4})
    observed = Observations(pods=(pod("a", 2), asleep("p1"), woken_by_router("p2", 2)), router=router)
    plan = svc.planner.plan(1.0, observed, svc.spec, svc.status)
    svc.apply(plan)
    assert plan.changes()[0].desired == 2 and plan.woken() == ("p2",)  # the one the router woke, first
    assert "p2" not in plan.parked() and "p1" in plan.parked()
    assert "(p2 by the router, when every awake replica passed its target)" in svc.events("WokenFromStandby")[0]
    assert "the router woke p2 from standby as every awake replica passed its target of 4 in flight: 1 + 1 = 2" in (
        svc.status["autoscaler"]["formula"]
    )
    # A tick later its label is still on (the handler's patch has not landed): it is not counted twice.
    later = svc.planner.plan(2.0, observed, svc.spec, svc.status)
    svc.apply(later)
    assert not later.changes() and svc.spec.replicas == 2
    # Without a router's word an awake parked pod is only a pod not yet asleep: it is parked again.
    again = Service(standby_spec(replicas=1, router={"enabled": True}))
    plan = again.tick(0.0, [pod("a", 2), asleep("p1"), woken_by_router("p2", 0)], held=0)
    assert not plan.changes() and set(plan.parked()) == {"p1", "p2"}


def test_a_pod_the_router_woke_is_taken_in_without_the_scale_up_window() -> None:
    window = {"scaleUpStabilizationSeconds": 30}
    svc = Service(standby_spec(replicas=1, router={"enabled": True}, autoscaling={"standby": {"replicas": 2}, **window}))
    svc.tick(0.0, [pod("a", 2), asleep("p1"), asleep("p2")], held=0)
    router = RouterDemand(held=0, woken={"p1": 0.2, "p2": 0.1})
    observed = Observations(pods=(pod("a", 2), woken_by_router("p1", 2), woken_by_router("p2", 2)), router=router)
    plan = svc.planner.plan(1.0, observed, svc.spec, svc.status)
    assert plan.changes()[0].desired == 3 and set(plan.woken()) == {"p1", "p2"}
