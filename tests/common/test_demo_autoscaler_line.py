"""The demo prints the autoscaler's decision as sentences, not a JSON dump."""

from plimsoll.demo import autoscaler_lines


def test_a_capped_scale_up_reads_as_saw_wants_does() -> None:
    status = {
        "formula": "ceil(1 × 4 / 1) = 4",
        "inputs": {"targetInFlightPerReplica": 1, "averageInFlightPerPod": 4.0, "inFlight": 4.0, "waiting": 2.0,
                   "readyPods": 1, "minReplicas": 1, "maxReplicas": 2},
        "decision": {"currentReplicas": 1, "desiredReplicas": 2, "recommendation": 4, "reason": "ScaleUp",
                     "message": "above target", "scalingLimited": False, "limitedReason": "TooManyReplicas"},
    }  # fmt: skip
    assert autoscaler_lines(status) == [
        "autoscaler saw: 4 requests in flight and 2 waiting on 1 ready pod(s), 4 per pod against a target of "
        "1 per replica",
        "autoscaler wants: 4 replica(s), by ceil(1 × 4 / 1) = 4; capped at maxReplicas 2 (TooManyReplicas)",
        "autoscaler does: scales 1 → 2 replicas (ScaleUp: above target); ScalingLimited turns true only at "
        "maxReplicas 2 if still overloaded",
    ]
    assert not any("{" in line for line in autoscaler_lines(status))


def test_idle_and_empty() -> None:
    assert autoscaler_lines({}) == ["autoscaler: no decision recorded yet"]
    idle = {"decision": {"reason": "NoTarget", "message": "the capacity profile is still running"}}
    assert autoscaler_lines(idle) == ["autoscaler: idle, the capacity profile is still running"]
