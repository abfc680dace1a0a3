"""The replica planner on a split service (``spec.disaggregation``): each pool on its own signal.

The prefill pool scales on its backlog (waiting prompt tokens ÷ the profiled prefill rate, seconds per
replica), the decode pool (the service's replicas) on its decode load (running ÷ target sequences, or
KV use); ``status.disaggregation`` says each pool's formula and, with both profiles and a link, whether
the split pays. Driven through ``planner_cases.Service`` as the handler applies plans.
"""

import dataclasses
from typing import Any

import pytest
from planner_cases import Service, pod, sample, spec

from plimsoll.operator.scaling.observations import PodObservation
from plimsoll.operator.scaling.pools import PREFILL_POOL, decode_load_of, split_status

PREFILL_RATE = 1000.0  # prompt tokens/s one prefill replica computes (its profile)


def split_spec(**over: Any) -> Any:
    """1..4 decode replicas (now 1), 1..3 prefill (now 1), the decode target 4 sequences, backlog target 0.5 s."""
    disaggregation = {
        "prefill": {"replicas": 1, "min": 1, "max": 3, "targetBacklogSeconds": 0.5},
        "decode": {"targetSequencesPerReplica": 4},
        **over.pop("disaggregation", {}),
    }
    over.setdefault("capacity", {"mode": "Profile"})
    return spec(scaling={"max": 4}, disaggregation=disaggregation, **over)


def profiled(prefill_rate: float | None = PREFILL_RATE) -> dict[str, Any]:
    block: dict[str, Any] = {"decode": {"profile": {"sequencesPerReplica": 4, "tpotSeconds": 0.02}}}
    if prefill_rate is not None:
        block["prefill"] = {"profile": {"promptTokensPerSecond": prefill_rate}}
    return {"disaggregation": block}


def prefill_pod(name: str, backlog_tokens: float) -> PodObservation:
    return pod(name, sample=dataclasses.replace(sample(), prefill_backlog_tokens=backlog_tokens))


def test_the_prefill_pool_scales_on_its_backlog_alone() -> None:
    svc = Service(split_spec(), status=profiled())
    # 1,500 waiting prompt tokens at 1,000 tokens/s: 1.5 s of backlog against 0.5 s per replica -> 3.
    # The decode pod is idle: its own pool stays where it is.
    plan = svc.tick(0.0, [pod("d0", 0)], prefill_pods=(prefill_pod("p0", 1500),))
    (count,) = plan.changes()
    assert (count.pool, count.current, count.desired, count.reason) == (PREFILL_POOL, 1, 3, "ScaledUp")
    assert svc.spec.disaggregation is not None and svc.spec.disaggregation.prefill.replicas == 3
    assert svc.spec.replicas == 1
    block = svc.status["disaggregation"]["prefill"]["autoscaler"]
    assert "waiting prompt tokens ÷ 1,000 tokens/s" in block["inputs"]["signal"]
    assert block["inputs"]["target"] == 0.5 and block["inputs"]["averagePerPod"] == pytest.approx(1.5)
    assert svc.events("PrefillScaledUp") == [
        "prefill pool 1 → 3: ceil(1 × 1.5 / 0.5) = 3; seconds of prompt backlog per pod above target"
    ]
    assert not svc.events("ScaledUp")
    # The backlog gone, the prefill pool comes down at once to its min (no drain: it holds a request a moment).
    idle = [prefill_pod(f"p{i}", 0) for i in range(3)]
    down = svc.tick(10.0, [pod("d0", 0)], prefill_pods=tuple(idle))
    (count,) = down.changes()
    assert (count.pool, count.desired, count.reason) == (PREFILL_POOL, 1, "ScaledDown")
    assert not down.drained()


def test_the_decode_pool_scales_on_running_sequences_or_kv_use_not_in_flight_per_target() -> None:
    svc = Service(split_spec(), status=profiled())
    # 6 running against 4 per replica -> load 1.5 -> ceil(1 × 1.5 / 1) = 2 decode replicas.
    plan = svc.tick(0.0, [pod("d0", 6)], prefill_pods=(prefill_pod("p0", 0),))
    (count,) = plan.changes()
    assert (count.pool, count.current, count.desired) == ("default", 1, 2)
    assert "decode load = max(running ÷ 4" in svc.status["autoscaler"]["inputs"]["targetSource"]
    decode = svc.status["disaggregation"]["decode"]["autoscaler"]
    assert decode["inputs"]["signal"] == "decode load" and decode["decision"]["desiredReplicas"] == 2
    assert decode["decision"]["message"] == "decode load per pod above target"
    # Two running sequences but the KV cache 95% full (over 0.85): full all the same -> a third replica.
    full = dataclasses.replace(sample(2), kv_usage=0.95)
    plan = svc.tick(
        5.0, [pod("d0", sample=full), pod("d1", sample=full)], prefill_pods=(prefill_pod("p0", 0),)
    )
    (count,) = plan.changes()
    assert (count.current, count.desired) == (2, 3)


def test_a_decode_drain_is_judged_on_the_decode_load() -> None:
    """Kept replicas with 3 running each are under 4 sequences: the drain goes on (in-flight 3 > 1.0 would not)."""
    svc = Service(split_spec(replicas=3), status=profiled())
    plan = svc.tick(0.0, [pod("a", 0), pod("b", 0), pod("c", 3)], prefill_pods=(prefill_pod("p0", 0),))
    assert set(plan.drained()) == {"a", "b"}
    marked = [pod("a", 0, draining=True, ready=False), pod("b", 0, draining=True, ready=False), pod("c", 3)]
    again = svc.tick(1.0, marked, prefill_pods=(prefill_pod("p0", 0),))
    assert not svc.events("DrainCancelled")
    (count,) = again.changes()
    assert (count.current, count.desired) == (3, 1)
    # Overloaded in the decode sense (5 running > 4): the next drain is called off.
    svc2 = Service(split_spec(replicas=2), status=profiled())
    svc2.tick(0.0, [pod("a", 0), pod("b", 1)], prefill_pods=(prefill_pod("p0", 0),))
    svc2.tick(
        1.0, [pod("a", 0, draining=True, ready=False), pod("b", 5)], prefill_pods=(prefill_pod("p0", 0),)
    )
    assert svc2.events("DrainCancelled") and "more than 1 each" in svc2.events("DrainCancelled")[0]


def test_before_the_profiles_each_pool_says_what_it_waits_for() -> None:
    svc = Service(split_spec(disaggregation={"decode": {}}), status={})
    plan = svc.tick(0.0, [pod("d0", 9)], prefill_pods=(prefill_pod("p0", 5000),))
    assert not plan.changes()
    assert svc.status["autoscaler"]["decision"]["reason"] == "NoTarget"
    assert "decode pool has no target yet" in svc.status["autoscaler"]["decision"]["message"]
    prefill = svc.status["disaggregation"]["prefill"]["autoscaler"]["decision"]
    assert prefill["reason"] == "NoTarget" and "no measured prefill rate" in prefill["message"]
    reasons = " ".join(svc.status["disaggregation"]["reasons"])
    assert (
        "the prefill profile, the decode profile" in reasons
        and svc.status["disaggregation"]["prediction"] is None
    )


def test_in_manual_mode_the_prefill_pool_says_it_stays_at_its_count() -> None:
    svc = Service(split_spec(capacity={"mode": "Manual", "concurrencyPerReplica": 4}), status={})
    svc.tick(0.0, [pod("d0", 1)], prefill_pods=(prefill_pod("p0", 5000),))
    prefill = svc.status["disaggregation"]["prefill"]["autoscaler"]["decision"]
    assert prefill["reason"] == "NoTarget" and "use capacity.mode Profile" in prefill["message"]
    assert svc.spec.disaggregation is not None and svc.spec.disaggregation.prefill.replicas == 1


def test_split_status_predicts_from_both_profiles_and_the_link() -> None:
    # Long prompts, short outputs and a tight TPOT SLO: an aggregated replica's prefills stall its decodes.
    tight = split_spec(disaggregation={"linkBandwidth": "10GB/s"}, slo={"tpotP50Ms": 25},
                       capacity={"mode": "Profile", "profile": {"workload": {"inputTokens": 2000, "outputTokens": 64}}})  # fmt: skip
    status = profiled()
    out = split_status(tight, status, 1, 1, kv_bytes_per_token=20_000)
    assert out["prediction"]["choice"] == "split" and "the prediction agrees" in out["reasons"][1]
    # The same over a slow link: moving 40 MB per prompt at 1 MB/s loses.
    slow = tight.model_copy(
        update={"disaggregation": tight.disaggregation.model_copy(update={"link_bandwidth": "1MB/s"})}
    )
    out = split_status(slow, status, 1, 1, kv_bytes_per_token=20_000)
    assert (
        out["prediction"]["choice"] == "aggregated"
        and "consider removing spec.disaggregation" in out["reasons"][1]
    )
    assert out["prediction"]["linkBandwidth"] == "1MB/s"


def test_the_planner_writes_the_prediction_when_a_replica_reports_its_kv_size() -> None:
    svc = Service(split_spec(disaggregation={"linkBandwidth": "10GB/s"}), status=profiled())
    decode = pod("d0", sample=dataclasses.replace(sample(1), kv_bytes_per_token=20_000))
    svc.tick(0.0, [decode], prefill_pods=(prefill_pod("p0", 0),))
    block = svc.status["disaggregation"]
    assert block["runs"] == "split" and block["prediction"] is not None
    assert block["prediction"]["linkBandwidth"] == "10GB/s"


def test_decode_load_of_takes_the_larger_of_sequences_and_kv() -> None:
    load = decode_load_of(split_spec(), profiled())
    assert load(sample(2)) == pytest.approx(0.5)
    assert load(dataclasses.replace(sample(2), kv_usage=0.85)) == pytest.approx(1.0)


def test_an_unchanged_split_is_not_rewritten_and_keeps_what_other_writers_put_there() -> None:
    svc = Service(split_spec(), status=profiled())
    first = svc.tick(0.0, [pod("d0", 2)], prefill_pods=(prefill_pod("p0", 100),))
    assert first.status is not None and "disaggregation" in first.status.fields
    assert "profile" not in first.status.fields["disaggregation"]["prefill"]  # the profiling handler's
    again = svc.tick(20.0, [pod("d0", 2)], prefill_pods=(prefill_pod("p0", 100),))
    assert again.status is None or "disaggregation" not in again.status.fields
    assert svc.status["disaggregation"]["prefill"]["profile"]["promptTokensPerSecond"] == PREFILL_RATE


def test_standby_parks_beside_the_decode_pool_whatever_the_prefill_count() -> None:
    # The decode Deployment runs its one replica plus one parked: the prefill pool going 1 -> 3 in the
    # same tick is not a count of decode replicas to keep awake.
    svc = Service(split_spec(autoscaling={"standby": {"replicas": 1}}), status=profiled())
    new = pod("n1", ready=False, sample=None)
    plan = svc.tick(0.0, [pod("d0", 0), new], prefill_pods=(prefill_pod("p0", 1500),))
    (count,) = plan.changes()
    assert (count.pool, count.desired) == (PREFILL_POOL, 3)
    assert set(plan.parked()) == {"n1"} and not plan.woken()


def test_the_predicted_ttft_rule_is_left_to_the_prefill_pool() -> None:
    # Prompts wait in the prefill pool, which scales on that backlog; the decode pool's formula takes no
    # predicted-TTFT floor from its replicas' (empty) prompt queue.
    svc = Service(split_spec(slo={"ttftP95Ms": 500}), status=profiled())
    busy = dataclasses.replace(sample(), backlog_s=5.0, predicted_ttft_s=5.0)
    plan = svc.tick(0.0, [pod("d0", sample=busy)], prefill_pods=(prefill_pod("p0", 1500),))
    assert [c.pool for c in plan.changes()] == [PREFILL_POOL]
    assert "tokenAware" not in svc.status["autoscaler"]
