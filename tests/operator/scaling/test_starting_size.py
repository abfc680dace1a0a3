"""The starting replica count: expectedLoad ÷ per-replica target, written once, never over a later decision."""

import math
from typing import Any

import pytest
from pydantic import ValidationError

from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.scaling.starting_size import plan_start


def spec(**extra: Any) -> LLMServiceSpec:
    body: dict[str, Any] = {
        "model": {"uri": "embedded://smollm2-135m"},
        "scaling": {"min": 1, "max": 6},
        "capacity": {"mode": "Manual", "concurrencyPerReplica": 4},
    }
    body.update(extra)
    return LLMServiceSpec.model_validate(body)


@pytest.mark.parametrize(
    ("load", "per_replica", "bounds", "expected"),
    [
        ({"concurrency": 14}, 4, (1, 6), math.ceil(14 / 4)),  # 4
        ({"concurrency": 16}, 4, (1, 6), 4),  # exact multiple: no extra replica
        ({"concurrency": 0.5}, 4, (2, 6), 2),  # clamped up to min
        ({"concurrency": 100}, 4, (1, 6), 6),  # clamped down to max
        ({"requestsPerSecond": 3, "avgLatencySeconds": 2.5}, 4, (1, 6), math.ceil(3 * 2.5 / 4)),  # 2
        ({"requestsPerSecond": 0.3, "avgLatencySeconds": 0.1}, 0.01, (1, 6), 3),  # exact: 0.03/0.01
    ],
)
def test_sized_count_is_the_clamped_ceiling(
    load: dict[str, float], per_replica: float, bounds: tuple[int, int], expected: int
) -> None:
    s = spec(
        expectedLoad=load,
        scaling={"min": bounds[0], "max": bounds[1]},
        autoscaling={"targetInFlightPerReplica": per_replica},
    )
    plan = plan_start(s, None)
    assert plan is not None and plan.write and plan.reason == "Sized"
    assert plan.replicas == expected
    assert plan.inputs["targetInFlightPerReplica"] == per_replica
    assert plan.inputs["targetSource"] == "override"


def test_status_and_event_spell_out_the_arithmetic() -> None:
    plan = plan_start(spec(expectedLoad={"concurrency": 14}), None)
    assert plan is not None
    assert plan.formula == "concurrency 14; ceil(14 / 4 per replica (manual)) = 4"
    status = plan.to_status("2026-11-29T16:00:00Z")
    assert status["replicas"] == 4 and status["reason"] == "Sized"
    assert status["inputs"] == {
        "concurrency": 14,
        "inFlight": 14,
        "targetInFlightPerReplica": 4,
        "targetSource": "manual",
        "minReplicas": 1,
        "maxReplicas": 6,
    }
    assert plan.event_message().startswith("concurrency 14; ceil(14 / 4")
    assert "the built-in autoscaler owns the count" in plan.event_message()
    rate = plan_start(spec(expectedLoad={"requestsPerSecond": 10, "avgLatencySeconds": 2}), None)
    assert rate is not None and rate.replicas == 5
    assert rate.formula is not None and rate.formula.startswith("Little's law: 10 req/s × 2 s = 20 in flight")


def test_profile_target_once_measured_and_min_until_then() -> None:
    profiled = spec(
        capacity={"mode": "Profile"}, scaling={"min": 2, "max": 6}, expectedLoad={"concurrency": 30}
    )
    waiting = plan_start(profiled, None)
    assert waiting is not None and (waiting.replicas, waiting.write, waiting.reason) == (
        2,
        False,
        "WaitingForTarget",
    )
    assert "capacity profile" in waiting.message
    sized = plan_start(profiled, 7)
    assert sized is not None and (sized.replicas, sized.write) == (math.ceil(30 / 7), True)
    assert sized.inputs["targetSource"] == "profile"


def test_a_count_already_in_spec_replicas_is_never_overridden() -> None:
    """Whoever wrote spec.replicas (the autoscaler, an HPA, the user) owns it; sizing stands aside."""
    assert plan_start(spec(expectedLoad={"concurrency": 14}, replicas=2), None) is None
    assert plan_start(spec(), None) is None  # no expectedLoad, builtin mode: scaling.min as before


def test_hpa_and_keda_get_a_count_to_scale_from() -> None:
    plan = plan_start(spec(scaling={"min": 2, "max": 5}, autoscaling={"mode": "hpa"}), None)
    assert plan is not None and (plan.replicas, plan.write, plan.reason) == (2, True, "ScaleTargetSeeded")
    sized = plan_start(spec(autoscaling={"mode": "hpa"}, expectedLoad={"concurrency": 9}), None)
    assert sized is not None and sized.replicas == 3 and "the HPA owns the count" in sized.message


def test_without_scaling_the_sized_count_is_the_fixed_count() -> None:
    body = {
        "model": {"uri": "embedded://smollm2-135m"},
        "capacity": {"mode": "Manual", "concurrencyPerReplica": 4},
    }
    s = LLMServiceSpec.model_validate({**body, "expectedLoad": {"concurrency": 30}})
    plan = plan_start(s, None)
    assert plan is not None and plan.replicas == 8 and plan.inputs.get("minReplicas") is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"expectedLoad": {"requestsPerSecond": 3}}, "requestsPerSecond needs avgLatencySeconds"),
        (
            {"autoscaling": {"mode": "keda"}, "scaling": {"min": 1, "max": 3}},
            "needs autoscaling.prometheusAddress",
        ),
        ({"autoscaling": {"mode": "hpa"}, "scaling": None}, "hpa needs scaling.min and scaling.max"),
        (
            {"autoscaling": {"mode": "keda", "prometheusAddress": "prometheus:9090"}},
            "should match pattern",
        ),
    ],
)
def test_specs_that_cannot_be_sized_or_scaled_are_refused_with_the_fix(
    extra: dict[str, Any], message: str
) -> None:
    body: dict[str, Any] = {"model": {"uri": "embedded://smollm2-135m"}, "scaling": {"min": 1, "max": 3}}
    body.update({k: v for k, v in extra.items() if v is not None})
    if extra.get("scaling", 1) is None:
        body.pop("scaling")
    with pytest.raises(ValidationError, match=message):
        LLMServiceSpec.model_validate(body)


def test_hpa_never_starts_at_zero() -> None:
    plan = plan_start(spec(scaling={"min": 0, "max": 5}, autoscaling={"mode": "hpa"}), None)
    assert plan is not None and plan.replicas == 1
    sized = plan_start(
        spec(scaling={"min": 0, "max": 5}, autoscaling={"mode": "hpa"}, expectedLoad={"concurrency": 0}), None
    )
    assert sized is not None and sized.replicas == 1 and "at least 1" in sized.message
