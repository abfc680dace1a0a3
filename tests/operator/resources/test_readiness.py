"""Status derived from the Deployment: Ready/Progressing/Degraded and the scale-subresource fields."""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import get_condition
from plimsoll.operator.resources.readiness import build_status, invalid_spec_status


def _svc(replicas: int = 2, generation: int = 4, router: bool = False) -> LLMService:
    return LLMService.from_body(
        {
            "metadata": {"name": "chat", "namespace": "ns", "generation": generation},
            "spec": {
                "model": {"uri": "embedded://smollm2-135m"},
                "replicas": replicas,
                "autoscaling": {"mode": "off"},
                "router": {"enabled": router},
            },
        }
    )


def _deployment(generation: int = 1, observed: int = 1, **status: Any) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "status": {"observedGeneration": observed, **status}}


def _cond(status: dict[str, Any], type_: str) -> tuple[str, str]:
    c = get_condition(status["conditions"], type_)  # type: ignore[arg-type]
    assert c is not None
    return c["status"], c["reason"]


def test_ready_when_all_replicas_updated_and_ready() -> None:
    status = build_status(_svc(), _deployment(replicas=2, readyReplicas=2, updatedReplicas=2), {}, now="t0")
    assert _cond(status, "Ready") == ("True", "AllReplicasReady")
    assert _cond(status, "Progressing") == ("False", "RolloutComplete")
    assert _cond(status, "Degraded") == ("False", "AsExpected")
    assert status["observedGeneration"] == 4
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert "plimsoll.dev/llmservice=chat" in status["selector"]
    assert status["endpoint"] == "http://chat.ns.svc:8000/v1"


def test_not_ready_while_pods_start() -> None:
    status = build_status(_svc(), _deployment(replicas=2, readyReplicas=1, updatedReplicas=2), {}, now="t0")
    assert _cond(status, "Ready") == ("False", "ReplicasNotReady")
    assert _cond(status, "Progressing")[0] == "True"


def test_stale_deployment_status_is_not_ready() -> None:
    # The Deployment controller has not seen the new template yet: old counts mean nothing.
    status = build_status(
        _svc(), _deployment(generation=3, observed=2, replicas=2, readyReplicas=2, updatedReplicas=2), {}
    )
    assert _cond(status, "Ready")[0] == "False"


def test_rollout_in_progress() -> None:
    status = build_status(_svc(), _deployment(replicas=3, readyReplicas=2, updatedReplicas=1), {})
    assert _cond(status, "Ready") == ("False", "RollingOut")


def test_missing_deployment_and_scaled_to_zero() -> None:
    assert _cond(build_status(_svc(), None, {}), "Ready") == ("False", "DeploymentMissing")
    assert _cond(build_status(_svc(replicas=0), _deployment(), {}), "Ready") == ("False", "ScaledToZero")


def test_degraded_on_replica_failure() -> None:
    failing = _deployment(
        replicas=0,
        conditions=[{"type": "ReplicaFailure", "status": "True", "message": "exceeded quota: gpu"}],
    )
    status = build_status(_svc(), failing, {})
    assert _cond(status, "Degraded") == ("True", "ReplicaFailure")


def test_transition_time_kept_across_refreshes() -> None:
    first = build_status(_svc(), _deployment(replicas=2, readyReplicas=2, updatedReplicas=2), {}, now="t0")
    again = build_status(_svc(), _deployment(replicas=2, readyReplicas=2, updatedReplicas=2), first, now="t1")
    assert again == first, "an unchanged observation must not change status (no patch churn)"


def test_other_components_conditions_survive() -> None:
    previous = {
        "conditions": [
            {
                "type": "Profiled",
                "status": "True",
                "reason": "ProfileMeasured",
                "message": "",
                "lastTransitionTime": "t",
            }
        ]
    }
    status = build_status(_svc(), _deployment(replicas=2, readyReplicas=2, updatedReplicas=2), previous)
    assert _cond(status, "Profiled") == ("True", "ProfileMeasured")


def test_invalid_spec_status() -> None:
    status = invalid_spec_status(7, {}, "spec.scaling: min above max")
    assert _cond(status, "Ready") == ("False", "InvalidSpec")
    assert _cond(status, "Degraded") == ("True", "InvalidSpec")
    assert status["observedGeneration"] == 7


def test_router_endpoint_and_ready_waits_for_a_ready_router_pod() -> None:
    replicas = _deployment(replicas=2, readyReplicas=2, updatedReplicas=2)
    missing = build_status(_svc(router=True), replicas, {}, now="t0", router=None)
    assert missing["endpoint"] == "http://chat-router.ns.svc:8000/v1"
    assert _cond(missing, "Ready") == ("False", "RouterNotReady")
    assert _cond(missing, "Progressing") == ("True", "RouterNotReady")
    assert "does not exist" in get_condition(missing["conditions"], "Ready")["message"]  # type: ignore[arg-type,index]

    starting = build_status(_svc(router=True), replicas, missing, now="t1", router=_deployment(replicas=1))
    assert _cond(starting, "Ready") == ("False", "RouterNotReady")
    assert "no ready pod" in get_condition(starting["conditions"], "Ready")["message"]  # type: ignore[arg-type,index]

    serving = build_status(
        _svc(router=True), replicas, starting, now="t2", router=_deployment(replicas=1, readyReplicas=1)
    )
    assert _cond(serving, "Ready") == ("True", "AllReplicasReady")
    # replicas/readyReplicas (the scale subresource) count the replicas, never the router.
    assert (serving["replicas"], serving["readyReplicas"]) == (2, 2)


def test_router_does_not_hide_unready_replicas_and_is_ignored_when_disabled() -> None:
    router = _deployment(replicas=1, readyReplicas=1)
    status = build_status(
        _svc(router=True), _deployment(replicas=2, readyReplicas=1, updatedReplicas=2), {}, router=router
    )
    assert _cond(status, "Ready") == ("False", "ReplicasNotReady")
    off = build_status(_svc(), _deployment(replicas=2, readyReplicas=2, updatedReplicas=2), {}, router=None)
    assert _cond(off, "Ready") == ("True", "AllReplicasReady")
    assert off["endpoint"] == "http://chat.ns.svc:8000/v1"
