"""The scale-up timeline from the pod object and the engine's own marks (pure, no cluster)."""

from typing import Any

from planner_cases import Service, spec
from planner_cases import pod as busy

from plimsoll.operator.scaling.metrics import PodSample, parse_scrape
from plimsoll.operator.scaling.observations import PodObservation
from plimsoll.operator.scaling.planner import ReplicaPlanner, same_decision
from plimsoll.operator.scaling.scale_up_timeline import PHASES, ScaleUpTimeline
from plimsoll.operator.scaling.timestamps import parse_time, rfc3339

T0 = parse_time("2026-12-02T01:00:00Z") or 0.0


def pod(name: str, *, created: float, scheduled: float | None = None, started: float | None = None,
        ready: float | None = None) -> dict[str, Any]:  # fmt: skip
    conditions = []
    if scheduled is not None:
        conditions.append(
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": rfc3339(scheduled)}
        )
    if ready is not None:
        conditions.append({"type": "Ready", "status": "True", "lastTransitionTime": rfc3339(ready)})
    statuses = [{"name": "engine", "state": {"running": {"startedAt": rfc3339(started)}}}] if started else []
    return {
        "metadata": {"name": name, "creationTimestamp": rfc3339(created)},
        "status": {"conditions": conditions, "containerStatuses": statuses},
    }


def sample(*, answered: float, startup: dict[str, float]) -> PodSample:
    return PodSample(
        engine="plimsoll", running=0.0, waiting=0.0, kv_usage=0.0, ttft=None, tpot=None,
        requests_finished=answered, startup=startup,
    )  # fmt: skip


ENGINE = {
    "imports": T0 + 9.0,
    "weights_loaded": T0 + 12.0,
    "kv_cache_allocated": T0 + 12.5,
    "warmup_done": T0 + 13.0,
}


def test_every_phase_is_marked_in_order_and_the_sentence_reads_them() -> None:
    old = pod("svc-a", created=T0 - 600, scheduled=T0 - 600, started=T0 - 599, ready=T0 - 590)
    timeline = ScaleUpTimeline(
        crossed_at=T0 - 5.0, decided_at=T0, from_replicas=1, to_replicas=2,
        existing_pods=frozenset({"svc-a"}), container="engine",
    )  # fmt: skip
    timeline.observe(T0 + 1, [old], {})
    assert timeline.pod is None and not timeline.complete
    new = pod("svc-b", created=T0 + 1, scheduled=T0 + 1)
    timeline.observe(T0 + 2, [old, new], {})
    assert timeline.pod == "svc-b" and "containerStarted" not in timeline.marks
    new = pod("svc-b", created=T0 + 1, scheduled=T0 + 1, started=T0 + 3, ready=T0 + 15)
    timeline.observe(T0 + 16, [old, new], {"svc-b": sample(answered=0.0, startup=ENGINE)})
    assert not timeline.complete, "Ready is not the end: the pod has not answered yet"
    timeline.observe(T0 + 21, [old, new], {"svc-b": sample(answered=3.0, startup=ENGINE)})
    assert timeline.complete
    status = timeline.to_status()
    assert [p["phase"] for p in status["phases"]] == list(PHASES)
    times = [parse_time(p["at"]) for p in status["phases"]]
    assert times == sorted(times)
    assert status["decisionToReadySeconds"] == 15.0 and status["decisionToFirstAnswerSeconds"] == 21.0
    took = timeline.phase_seconds()
    assert took["metricCrossedTarget"] == 0.0 and took["decided"] == 5.0 and took["weightsLoaded"] == 3.0
    assert sum(took.values()) == 26.0  # crossed (-5 s) to first answer (+21 s)
    sentence = timeline.sentence()
    assert sentence.startswith(
        "scale-up 1→2: in-flight crossed the target at -5 s, decided at +0 s, pod svc-b created at +1 s"
    )
    assert "weights loaded at +12 s" in sentence and sentence.endswith("first request answered at +21 s")


def test_a_vllm_replica_completes_without_engine_phases() -> None:
    timeline = ScaleUpTimeline(
        crossed_at=T0, decided_at=T0, from_replicas=1, to_replicas=2, existing_pods=frozenset()
    )
    new = pod("svc-b", created=T0 + 1, scheduled=T0 + 1, started=T0 + 2, ready=T0 + 30)
    vllm = PodSample(
        engine="vllm", running=0, waiting=0, kv_usage=0, ttft=None, tpot=None, requests_finished=1.0
    )
    timeline.observe(T0 + 31, [new], {"svc-b": vllm})
    assert timeline.complete and "weightsLoaded" not in timeline.marks


def test_a_timestamp_a_second_early_counts_as_a_zero_gap() -> None:
    # creationTimestamp has one-second resolution: 0.6 s after the decision reads as 0.4 s before it.
    timeline = ScaleUpTimeline(crossed_at=T0 + 0.4, decided_at=T0 + 0.4, from_replicas=1, to_replicas=2,
                               existing_pods=frozenset())  # fmt: skip
    timeline.observe(T0 + 2, [pod("svc-b", created=T0, scheduled=T0 + 1)], {})
    took = timeline.phase_seconds()
    assert took["podCreated"] == 0.0 and took["podScheduled"] == 0.6


def test_the_scrape_gives_absolute_engine_phase_times() -> None:
    text = (
        "# TYPE plimsoll_num_requests_running gauge\nplimsoll_num_requests_running 0\n"
        "# TYPE plimsoll_num_requests_waiting gauge\nplimsoll_num_requests_waiting 0\n"
        "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1000.5\n"
        "# TYPE plimsoll_startup_phase_seconds gauge\n"
        'plimsoll_startup_phase_seconds{model_name="m",phase="weights_loaded"} 4.25\n'
        "# TYPE plimsoll_request_success counter\n"
        'plimsoll_request_success_total{model_name="m",finished_reason="stop"} 2\n'
    )
    parsed = parse_scrape(text)
    assert parsed.startup == {"weights_loaded": 1004.75} and parsed.requests_finished == 2.0


def test_the_planner_notes_the_crossing_once_and_ignores_last_scale_up_when_comparing() -> None:
    svc = Service(spec(replicas=2, autoscaling={"scaleUpStabilizationSeconds": 600}))
    svc.tick(10.0, [busy("a", 5), busy("b", 5)])  # above 4 per replica: crossed, but held by the window
    svc.tick(15.0, [busy("a", 6), busy("b", 6)])
    assert svc.planner.crossed_at == 10.0
    svc.tick(20.0, [busy("a", 3), busy("b", 3)])
    assert svc.planner.crossed_at is None
    decision = {"time": "t1", "formula": "f"}
    assert same_decision({"time": "t0", "formula": "f", "lastScaleUp": {"pod": "x"}}, decision)


def test_a_scale_up_is_followed_to_the_first_answer_and_written_once() -> None:
    svc = Service(spec(replicas=1), planner=ReplicaPlanner("engine"))
    old = pod("svc-a", created=T0 - 600, scheduled=T0 - 600, started=T0 - 599, ready=T0 - 590)
    loaded = PodSample(engine="plimsoll", running=8.0, waiting=0.0, kv_usage=0.0, ttft=None, tpot=None,
                       requests_finished=1.0, startup=ENGINE)  # fmt: skip
    plan = svc.tick(T0, [PodObservation("svc-a", True, loaded)], pod_objects=(old,))
    assert plan.count() is not None and plan.count().desired == 2  # type: ignore[union-attr]
    new = pod("svc-b", created=T0 + 1, scheduled=T0 + 1, started=T0 + 3, ready=T0 + 15)
    answered = sample(answered=3.0, startup=ENGINE)
    observed = [PodObservation("svc-a", True, loaded), PodObservation("svc-b", True, answered)]
    plan = svc.tick(T0 + 21, observed, pod_objects=(old, new))
    assert plan.status is not None and "lastScaleUp" in plan.status.fields["autoscaler"]
    assert set(plan.scale_up_phases) == set(PHASES) - {"metricCrossedTarget"}
    assert [e.reason for e in plan.events if e.reason == "ScaleUpTimeline"] == ["ScaleUpTimeline"]
    assert svc.status["autoscaler"]["lastScaleUp"]["complete"] is True
    again = svc.tick(T0 + 22, observed, pod_objects=(old, new))
    assert not again.scale_up_phases and not [e for e in again.events if e.reason == "ScaleUpTimeline"]
