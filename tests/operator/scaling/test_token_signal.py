"""The predicted-TTFT rule, pure and through the planner: the queue in seconds against spec.slo.ttftP95Ms."""

from typing import Any

from planner_cases import Service, pod, spec

from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import PodObservation
from plimsoll.operator.scaling.token_signal import predicted_ttft_recommendation


def load(
    running: float, waiting: float, backlog: float, predicted: float, kv: float | None = 0.5
) -> PodSample:
    return PodSample(engine="plimsoll", running=running, waiting=waiting, kv_usage=kv, ttft=None, tpot=None,
                     backlog_s=backlog, predicted_ttft_s=predicted)  # fmt: skip


def busy(name: str, backlog: float, predicted: float, **kw: Any) -> PodObservation:
    return pod(name, sample=load(2, 2, backlog, predicted), **kw)


def slo_spec(**over: Any) -> Any:
    return spec(slo={"ttftP95Ms": 500}, scaling={"min": 1, "max": 6}, **over)


def test_a_queue_within_the_slo_asks_nothing_and_says_so() -> None:
    svc = Service(slo_spec())
    plan = svc.tick(0.0, [busy("a", 0.1, 0.2)])  # 4 in flight at target 4: within tolerance
    assert not plan.changes()
    token = svc.status["autoscaler"]["tokenAware"]
    assert token["reason"] == "WithinSLO" and token["recommendation"] is None
    assert token["inputs"]["predictedTtftSeconds"] == 0.2 and token["inputs"]["kvHeadroom"] == 0.5


def test_queueing_behind_the_knee_scales_up_where_in_flight_alone_would_not() -> None:
    svc = Service(slo_spec())
    # In flight 4 = the target (the HPA formula holds), but a request would wait 1 s, then 0.1 s of its own.
    plan = svc.tick(0.0, [busy("a", 1.0, 1.1)])
    (count,) = plan.changes()
    assert (count.current, count.desired) == (1, 3)
    decision = svc.status["autoscaler"]["decision"]
    assert decision["reason"] == "PredictedTTFTAboveSLO"
    assert "ceil(1 × 1 / 0.4) = 3 needed" in svc.status["autoscaler"]["formula"]
    assert "1 Ready + 0 starting in time = 1; 1 + 2 = 3" in svc.status["autoscaler"]["formula"]
    assert svc.status["autoscaler"]["tokenAware"]["recommendation"] == 3
    assert svc.events("ScaledUp")[0].startswith("1 → 3: ceil(1 × 4 / 4) = 1; predicted TTFT 1.1 s")


def test_replicas_already_starting_in_time_are_credited() -> None:
    svc = Service(slo_spec(replicas=3), {"coldStart": {"samplesSeconds": [30.0], "p95Seconds": 30.0}})
    starting = [pod(n, ready=False, sample=None, created_at=-20.0) for n in ("s1", "s2")]  # Ready in ~10 s
    plan = svc.tick(0.0, [busy("a", 1.0, 1.1), *starting])
    assert not plan.changes()  # 3 needed: 1 Ready + 2 on their way
    inputs = svc.status["autoscaler"]["tokenAware"]["inputs"]
    assert inputs["creditedStarting"] == 2 and inputs["neededReplicas"] == 3


def test_a_stuck_starting_replica_is_not_credited() -> None:
    svc = Service(slo_spec(replicas=2), {"coldStart": {"samplesSeconds": [30.0], "p95Seconds": 30.0}})
    stuck = pod("s1", ready=False, sample=None, created_at=-100.0)  # 100 s into a 30 s start: not coming
    svc.tick(0.0, [busy("a", 1.0, 1.1), stuck])
    token = svc.status["autoscaler"]["tokenAware"]
    assert token["inputs"]["creditedStarting"] == 0 and token["recommendation"] == 4  # 2 + (3 − 1)


def test_pure_rule_unreachable_and_without_signal() -> None:
    ready = (PodObservation("a", True, load(1, 0, 0.0, 0.9)),)
    unreachable = predicted_ttft_recommendation(0.0, 1, ready, 0.5, 30.0, 30.0)
    assert unreachable.reason == "SLOUnreachable" and unreachable.recommendation is None
    plain = PodSample(engine="vllm", running=1, waiting=3, kv_usage=0.9, ttft=None, tpot=None)
    silent = predicted_ttft_recommendation(0.0, 1, (PodObservation("a", True, plain),), 0.5, 30.0, 30.0)
    assert silent.reason == "NoTokenSignal" and silent.inputs["kvHeadroom"] == 0.1


def test_a_parked_replica_to_wake_is_sooner_than_those_starting() -> None:
    # Starting pods 10 s from Ready are not credited when a parked one wakes in 1 s: wake instead.
    starting = tuple(PodObservation(n, False, None, created_at=-20.0) for n in ("s1", "s2"))
    ready = (PodObservation("a", True, load(2, 2, 1.0, 1.1)),)
    signal = predicted_ttft_recommendation(0.0, 3, ready + starting, 0.5, 30.0, 1.0)
    assert signal.inputs["creditedStarting"] == 0 and signal.recommendation == 5


def test_the_rule_is_off_without_an_slo_or_when_turned_off() -> None:
    plain = Service(spec(slo={"preset": "none"}))
    plain.tick(0.0, [busy("a", 1.0, 1.1)])
    assert "tokenAware" not in plain.status["autoscaler"]
    # The interactive preset's objective (TTFT p95 3 s) is an SLO like any other: 1.1 s is within it.
    preset = Service(spec())
    preset.tick(0.0, [busy("a", 1.0, 1.1)])
    assert preset.status["autoscaler"]["tokenAware"]["reason"] == "WithinSLO"
    off = Service(slo_spec(autoscaling={"tokenAware": False}))
    assert not off.tick(0.0, [busy("a", 1.0, 1.1)]).changes()
