"""The status writer against a real kube-apiserver: a write in between is a 409, recomputed, never lost.

``update_status`` reads the LLMService, asks the writer's ``change`` for the new
fields on that copy, and patches with the copy's resourceVersion. Here the
``change`` itself writes the object (as reconcile or the autoscaler would between
our read and our patch), so the API server must refuse the first patch; the
second attempt must start from the object with that write in it, and both
writers' conditions must end up stored.
"""

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import kopf
import pytest
from llms_k8s import apply, get_json, llmservice

from plimsoll.operator.api.status import ConditionStatus, ConditionType, set_condition
from plimsoll.operator.handlers import status_writer
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.status_writer import update_status, with_conditions

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]

NAME = "writer"
OLD_TIME = "2020-01-01T00:00:00Z"


@pytest.fixture
def namespace(devcluster: Any, operator_release: str) -> Iterator[str]:
    """A namespace with one LLMService (the CRD comes with the chart; no operator is needed)."""
    name = f"writer-{uuid.uuid4().hex[:6]}"
    devcluster.kubectl("create", "namespace", name)
    apply(devcluster, name, llmservice(NAME))
    try:
        yield name
    finally:
        devcluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
async def kube(devcluster: Any) -> AsyncIterator[Kube]:
    client = await Kube.connect(str(devcluster.kubeconfig))
    try:
        yield client
    finally:
        await client.close()


def _write_between(
    devcluster: Any, ns: str, status: dict[str, Any], type_: ConditionType, reason: str
) -> None:
    """Another writer's status patch (kubectl, no precondition): moves the resourceVersion on."""
    conditions = set_condition(
        list(status.get("conditions") or []), type_, "True", reason, "written in between"
    )
    devcluster.kubectl(
        "patch", "llms", NAME, "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"conditions": conditions}}),
    )  # fmt: skip


def _conditions(devcluster: Any, ns: str) -> dict[str, dict[str, Any]]:
    obj = get_json(devcluster, "llms", NAME, "-n", ns)
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


async def test_a_write_between_read_and_patch_is_a_conflict_and_is_kept(
    devcluster: Any, namespace: str, kube: Kube
) -> None:
    seen: list[dict[str, Any]] = []

    def change(status: dict[str, Any]) -> dict[str, Any]:
        seen.append(status)
        if len(seen) == 1:
            _write_between(devcluster, namespace, status, "SLOAtRisk", "OtherWriter")
        update = (("ScalingLimited", "False", "DesiredWithinRange", "ours"),)
        return {"conditions": with_conditions(status.get("conditions"), update, 1)}

    written = await update_status(kube, namespace, NAME, change)

    assert written is not None
    assert len(seen) >= 2, "the first patch carried a stale resourceVersion and must have been refused"
    assert "SLOAtRisk" not in {c["type"] for c in seen[0].get("conditions") or []}
    assert written.condition_before("SLOAtRisk") is not None, "the retry starts from the newer copy"
    stored = _conditions(devcluster, namespace)
    assert stored["SLOAtRisk"]["reason"] == "OtherWriter", "the other writer's condition survives"
    assert stored["ScalingLimited"]["reason"] == "DesiredWithinRange"


async def test_an_object_that_changes_under_every_attempt_is_a_temporary_error(
    devcluster: Any, namespace: str, kube: Kube
) -> None:
    calls: list[int] = []

    def change(status: dict[str, Any]) -> dict[str, Any]:
        calls.append(1)
        # A different reason each time, so every write in between really changes the object.
        _write_between(devcluster, namespace, status, "SLOAtRisk", f"Writer{len(calls)}")
        return {
            "conditions": with_conditions(status.get("conditions"), (("Degraded", "True", "Ours", ""),), 1)
        }

    with pytest.raises(kopf.TemporaryError):
        await update_status(kube, namespace, NAME, change)
    assert len(calls) == status_writer.ATTEMPTS
    # The chart's operator may reconcile this object and write a Degraded of its own; ours has reason "Ours".
    stored = _conditions(devcluster, namespace)
    assert stored.get("Degraded", {}).get("reason") != "Ours", "nothing written from a stale copy"


async def test_last_transition_time_moves_only_when_the_status_changes(
    devcluster: Any, namespace: str, kube: Kube
) -> None:
    # Seed a condition with a transition long ago, so "kept" and "moved" are told apart.
    devcluster.kubectl(
        "patch", "llms", NAME, "-n", namespace, "--subresource=status", "--type=merge", "-p",
        json.dumps({"status": {"conditions": [{"type": "Profiled", "status": "False", "reason": "Profiling",
                                               "message": "", "lastTransitionTime": OLD_TIME}]}}),
    )  # fmt: skip

    def profiled(state: ConditionStatus, reason: str) -> status_writer.StatusChange:
        def change(status: dict[str, Any]) -> dict[str, Any]:
            update = (("Profiled", state, reason, f"{state} {reason}"),)
            return {"conditions": with_conditions(status.get("conditions"), update, 1)}

        return change

    assert await update_status(kube, namespace, NAME, profiled("False", "WaitingForReplica")) is not None
    kept = _conditions(devcluster, namespace)["Profiled"]
    assert (kept["reason"], kept["lastTransitionTime"]) == ("WaitingForReplica", OLD_TIME)

    assert await update_status(kube, namespace, NAME, profiled("True", "ProfileMeasured")) is not None
    moved = _conditions(devcluster, namespace)["Profiled"]
    assert moved["status"] == "True" and moved["lastTransitionTime"] != OLD_TIME

    # The same condition again is not a write at all.
    assert await update_status(kube, namespace, NAME, profiled("True", "ProfileMeasured")) is None
