"""The replica planner, rule by rule, on explicit clocks: what each tick plans and what status reads after.

Each test drives one service through ``planner_cases.Service``, which applies a
plan the way the handler does (counts into the spec, one status write).
"""

import itertools

from planner_cases import Service, pod, sample, spec

from plimsoll.operator.scaling.planner import STATUS_MIN_INTERVAL_S, ReplicaPlanner
from plimsoll.operator.scaling.replica_plan import Drain, Undrain


def test_starting_size_is_written_once_onto_the_version_read() -> None:
    svc = Service(spec(replicas=None, expectedLoad={"concurrency": 14}, scaling={"max": 6}))
    plan = svc.tick(0.0, [])
    (count,) = plan.replicas
    assert (count.current, count.desired, count.reason, count.only_if_unchanged) == (None, 4, "Sized", True)
    assert "ceil(14 / 4 per replica (manual)) = 4" in count.formula
    assert svc.status["sizing"]["reason"] == "Sized" and len(svc.events("InitialSizing")) == 1
    later = svc.tick(5.0, [pod(f"p{i}", 3.5) for i in range(4)])
    assert not later.changes() and not svc.events("InitialSizing")[1:]


def test_plan_start_alone_serves_reconcile_and_every_mode() -> None:
    waiting = ReplicaPlanner.plan_start(0.0, spec(replicas=None, expectedLoad={"concurrency": 14},
                                                  capacity={"mode": "Profile"}), {})  # fmt: skip
    assert waiting is not None and not waiting.replicas and waiting.status is not None
    assert waiting.status.fields["sizing"]["reason"] == "WaitingForTarget"
    seeded = ReplicaPlanner.plan_start(0.0, spec(replicas=None, autoscaling={"mode": "hpa"}), {})
    assert (
        seeded is not None
        and seeded.replicas[0].desired == 1
        and seeded.replicas[0].reason == "ScaleTargetSeeded"
    )
    assert ReplicaPlanner.plan_start(0.0, spec(), {}) is None  # spec.replicas is set: nothing to size


def test_no_target_is_said_once() -> None:
    svc = Service(spec(capacity={"mode": "Profile"}))
    first = svc.tick(0.0, [pod("a", 3)])
    assert first.status is not None and svc.status["autoscaler"]["decision"]["reason"] == "NoTarget"
    assert svc.tick(5.0, [pod("a", 3)]).status is None


def test_a_scale_up_is_written_at_once_with_its_formula() -> None:
    svc = Service(spec())
    plan = svc.tick(0.0, [pod("a", 10)])
    (count,) = plan.changes()
    assert (count.current, count.desired, count.reason, count.formula) == (
        1,
        3,
        "ScaledUp",
        "ceil(1 × 10 / 4) = 3",
    )
    assert svc.events("ScaledUp") == ["1 → 3: ceil(1 × 10 / 4) = 3; in-flight per pod above target"]
    assert plan.status is not None and svc.status["autoscaler"]["decision"]["desiredReplicas"] == 3
    assert svc.planner.timeline is not None and svc.planner.timeline.to_replicas == 3


def test_a_scale_down_drains_first_then_lowers_the_count_by_exactly_those_pods() -> None:
    svc = Service(spec(replicas=3))
    plan = svc.tick(0.0, [pod("a", 1), pod("b", 0), pod("c", 2)])  # ceil(3 × 1 / 4) = 1: drop two
    assert not plan.changes() and set(plan.drained()) == {"b", "a"}  # the least loaded go
    assert svc.status["scaleDown"]["phase"] == "Draining" and svc.events("DrainStarted")
    marked = [pod("a", 1, draining=True, ready=False), pod("b", 0, draining=True, ready=False), pod("c", 2)]
    # Each tick of the drain says again that a and b stay marked (a restart or DELETE /drain undoes it).
    again = svc.tick(1.0, marked)
    assert not again.changes() and set(again.drained()) == {"a", "b"} and not again.undrained()
    emptied = [pod("a", 0, draining=True, ready=False), pod("b", 0, draining=True, ready=False), pod("c", 2)]
    done = svc.tick(2.0, emptied)
    (count,) = done.changes()
    assert (count.current, count.desired, count.reason) == (3, 1, "ScaledDown")
    assert svc.status["scaleDown"]["reason"] == "Drained"
    assert sorted(svc.status["scaleDown"]["lastPods"]) == ["a", "b"]
    assert "removing exactly those pods" in svc.events("ScaledDown")[0]
    # Until the ReplicaSet deletes them they stay marked; being deleted, they need nothing more.
    assert set(svc.tick(3.0, emptied).drained()) == {"a", "b"}
    leaving = [pod(n, 0, draining=True, ready=False, terminating=True) for n in ("a", "b")] + [pod("c", 2)]
    last = svc.tick(4.0, leaving)
    assert not last.actions and not last.changes()


def test_a_drain_is_called_off_when_the_kept_replicas_are_overloaded() -> None:
    svc = Service(spec(replicas=2))
    svc.tick(0.0, [pod("a", 0), pod("b", 1)])
    plan = svc.tick(1.0, [pod("a", 0, draining=True, ready=False), pod("b", 9)])  # a drains; b holds 9 > 4
    assert plan.undrained() == ("a",) and not plan.changes()
    assert (
        "called off" in svc.events("DrainCancelled")[0]
        and svc.status["scaleDown"]["reason"] == "DrainCancelled"
    )


def test_a_count_moved_by_another_writer_calls_the_drain_off() -> None:
    svc = Service(spec(replicas=3))
    svc.tick(0.0, [pod("a", 0), pod("b", 0), pod("c", 1)])
    svc.spec = svc.spec.model_copy(update={"replicas": 2})  # kubectl scale during the drain
    plan = svc.tick(1.0, [pod("a", 0, draining=True), pod("b", 0, draining=True), pod("c", 1)])
    assert set(plan.undrained()) == {"a", "b"} and not plan.changes()
    assert "moved to 2 by another writer" in svc.events("DrainCancelled")[0]


def test_an_operator_restart_goes_on_with_the_drain_from_status() -> None:
    svc = Service(spec(replicas=2))
    svc.tick(0.0, [pod("a", 0), pod("b", 1)])
    assert svc.status["scaleDown"]["pods"] == ["a"]
    restarted = Service(svc.spec, svc.status)  # a new planner, the stored status
    plan = restarted.tick(1.0, [pod("a", 1, draining=True, ready=False), pod("b", 1)])
    assert plan.drained() == ("a",) and not plan.undrained()  # still draining, not a stray
    done = restarted.tick(2.0, [pod("a", 0, draining=True, ready=False), pod("b", 1)])
    assert done.changes()[0].desired == 1


def test_a_marked_pod_no_drain_holds_is_unmarked() -> None:
    svc = Service(spec(replicas=2))
    plan = svc.tick(0.0, [pod("a", 3, draining=True), pod("b", 3)])  # 6 in flight on 2: no scale-down
    assert plan.actions == (Undrain("a", "marked for removal, but no drain holds it"),)
    gone = svc.tick(1.0, [pod("a", 3, draining=True, terminating=True), pod("b", 6)])
    assert not gone.actions  # on its way out anyway


def test_requests_cut_by_a_removed_pods_shutdown_are_counted_once_it_is_gone() -> None:
    svc = Service(spec(replicas=2))
    svc.tick(0.0, [pod("a", 0), pod("b", 1)])
    svc.tick(1.0, [pod("a", 0, draining=True, ready=False), pod("b", 1)])  # drained: 2 → 1
    cut = sample(cut=2.0)
    svc.tick(2.0, [pod("a", sample=cut, draining=True, ready=False, terminating=True), pod("b", 1)])
    plan = svc.tick(3.0, [pod("b", 1)])
    assert plan.requests_cut == 2.0 and svc.status["scaleDown"]["requestsCutTotal"] == 2.0
    assert svc.events("RequestsCut") == ["2 request(s) were cut by a scale-down's shutdown"]


def test_to_zero_after_the_idle_window_and_back_for_a_held_request() -> None:
    svc = Service(spec(scaling={"min": 0, "idleSeconds": 10}, router={"enabled": True}))
    for t in range(0, 10, 2):
        assert not svc.tick(float(t), [pod("a", 0)], held=0).actions
    plan = svc.tick(10.0, [pod("a", 0)], held=0)
    assert plan.drained() == ("a",) and "no request seen for 10 s" in svc.events("DrainStarted")[0]
    plan = svc.tick(11.0, [pod("a", 0, draining=True, ready=False)], held=0)
    assert plan.changes()[0].desired == 0 and plan.changes()[0].reason == "ScaledToZero"
    at_zero = svc.tick(12.0, [], held=0)
    assert svc.condition("ScalingLimited") == ("False", "ScaledToZero") and at_zero.status is not None
    assert svc.tick(13.0, [], held=0).status is None  # said once
    wake = svc.tick(14.0, [], held=3)
    (count,) = wake.changes()
    assert (count.current, count.desired, count.reason) == (0, 1, "ScaledFromZero")
    assert "3 request(s) held by the router" in svc.events("ScaledFromZero")[0]
    svc.tick(15.0, [pod("n", ready=False, sample=None)], held=3)
    svc.tick(31.5, [pod("n", 1)], held=0)  # Ready: the cold start is measured from the decision
    assert svc.status["coldStart"]["samplesSeconds"][-1] == 17.5


def test_a_request_during_the_drain_to_zero_calls_it_off() -> None:
    svc = Service(spec(scaling={"min": 0, "idleSeconds": 5}, router={"enabled": True}))
    svc.tick(0.0, [pod("a", 0)], held=0)
    svc.tick(5.0, [pod("a", 0)], held=0)
    plan = svc.tick(6.0, [pod("a", 1, draining=True, ready=False)], held=2)
    assert plan.undrained() == ("a",) and svc.events("DrainCancelled")


def test_an_unchanged_decision_is_written_at_most_every_interval() -> None:
    svc = Service(spec(replicas=2))
    busy = [pod("a", 4), pod("b", 4)]
    writes = [
        t for t in range(0, 60) if svc.tick(float(t), busy if t % 2 else [pod("a", 4), pod("b", 3)]).status
    ]
    assert writes[0] == 0 and all(b - a >= STATUS_MIN_INTERVAL_S for a, b in itertools.pairwise(writes))
    assert len(writes) <= 1 + 60 / STATUS_MIN_INTERVAL_S


def test_another_autoscaler_in_charge_plans_nothing_but_the_seed() -> None:
    svc = Service(spec(autoscaling={"mode": "hpa"}))
    plan = svc.tick(0.0, [pod("a", 40)])
    assert not plan.replicas and not plan.actions and plan.status is None
    assert isinstance(Drain("a", "x"), Drain)
