"""Initial sizing from expectedLoad on the local control plane.

The operator runs as a local process with the chart's RBAC; replica pods are
simulated by kwok (scheduled, given a loopback IP, made Ready). The Deployment
must start at ``clamp(ceil(in-flight / target), min, max)``, the arithmetic must
be readable in ``status.sizing`` and an ``InitialSizing`` Event, and a count
written later through the scale subresource (as the autoscaler or an HPA
writes it) must win over the initial sizing.
"""

import json
import math
from typing import Any

import pytest
from llms_k8s import apply, get_json, llmservice, wait_for, wait_for_passes

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.local import OperatorProcess
from plimsoll.operator.scaling.inputs import spec_profile_hash

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(240)]

TARGET = 4  # Manual concurrencyPerReplica


def sized_service(name: str, expected_load: dict[str, float]) -> dict[str, Any]:
    manifest = llmservice(
        name,
        scaling={"min": 1, "max": 6},
        autoscaling={"mode": "builtin", "intervalSeconds": 1},
        capacity={"mode": "Manual", "concurrencyPerReplica": TARGET},
        expectedLoad=expected_load,
    )
    del manifest["spec"]["replicas"]  # the count is the operator's to size
    return manifest


def deployment_replicas(cluster: Any, ns: str, name: str) -> int | None:
    deployment = get_json(cluster, "deployment", name, "-n", ns)
    return None if deployment is None else int(deployment["spec"]["replicas"])


def events(cluster: Any, ns: str, name: str, reason: str) -> list[str]:
    items = get_json(
        cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={name},reason={reason}"
    )
    return [e["message"] for e in (items or {}).get("items", [])]


@pytest.mark.parametrize(
    ("load", "in_flight"),
    [({"concurrency": 14}, 14.0), ({"requestsPerSecond": 5, "avgLatencySeconds": 2}, 10.0)],
    ids=["concurrency", "requests-per-second"],
)
def test_expected_load_sets_the_starting_replicas(
    devcluster: Any,
    llms_namespace: str,
    running_operator: OperatorProcess,
    load: dict[str, float],
    in_flight: float,
) -> None:
    ns, name = llms_namespace, "sized"
    expected = math.ceil(in_flight / TARGET)  # 14 / 4 → 4; 5 req/s × 2 s = 10 / 4 → 3
    apply(devcluster, ns, sized_service(name, load))

    wait_for(lambda: deployment_replicas(devcluster, ns, name) == expected, 60, f"Deployment at {expected}")
    svc = get_json(devcluster, "llms", name, "-n", ns)
    assert svc["spec"]["replicas"] == expected, (
        "the sized count is written to spec.replicas (scale subresource)"
    )
    sizing = svc["status"]["sizing"]
    assert (sizing["replicas"], sizing["reason"]) == (expected, "Sized")
    assert sizing["inputs"]["inFlight"] == in_flight
    assert sizing["inputs"]["targetInFlightPerReplica"] == TARGET
    assert sizing["inputs"]["targetSource"] == "manual"
    assert f"ceil({in_flight:g} / {TARGET} per replica (manual)) = {expected}" in sizing["formula"]
    messages = wait_for(lambda: events(devcluster, ns, name, "InitialSizing"), 30, "an InitialSizing Event")
    assert any(sizing["formula"] in m for m in messages)
    describe = devcluster.kubectl("describe", "llms", name, "-n", ns).stdout
    assert "InitialSizing" in describe and "Sized" in describe

    # A later count through the scale subresource (what the autoscaler or an HPA writes) wins,
    # and repeated reconciles (resync every 5 s in these tests) do not size it back.
    devcluster.kubectl("scale", "llms", name, "-n", ns, "--replicas=2")
    wait_for(
        lambda: deployment_replicas(devcluster, ns, name) == 2, 60, "Deployment following spec.replicas 2"
    )
    wait_for_passes(running_operator, "Timer 'resync_llmservice'", ns, name)
    assert deployment_replicas(devcluster, ns, name) == 2
    assert get_json(devcluster, "llms", name, "-n", ns)["spec"]["replicas"] == 2
    assert len(events(devcluster, ns, name, "InitialSizing")) == 1, "sized once, not on every reconcile"


def test_profile_mode_starts_at_min_and_is_sized_when_the_profile_arrives(
    devcluster: Any, llms_namespace: str
) -> None:
    """Before a profile there is no target: scaling.min, nothing written; the profile then sizes it once.

    The replicas are left unschedulable (a node selector no node has) so no replica is ever Ready
    and no benchmark Job starts; the test writes status.capacity itself, for the current spec hash,
    as the profiler would record it.
    """
    ns, name, image = llms_namespace, "profiled", "ghcr.io/plimsoll/plimsoll:test"
    manifest = sized_service(name, {"concurrency": 14})
    manifest["spec"]["capacity"] = {"mode": "Profile"}
    manifest["spec"]["engine"] = {"image": image}
    manifest["spec"]["scheduling"] = {"nodeSelector": {"plimsoll.dev/test": "nowhere"}}
    apply(devcluster, ns, manifest)

    def sizing_reason() -> str | None:
        svc = get_json(devcluster, "llms", name, "-n", ns) or {}
        return ((svc.get("status") or {}).get("sizing") or {}).get("reason")

    wait_for(lambda: sizing_reason() == "WaitingForTarget", 60, "sizing WaitingForTarget")
    svc = get_json(devcluster, "llms", name, "-n", ns)
    assert "replicas" not in svc["spec"]
    assert deployment_replicas(devcluster, ns, name) == 1  # scaling.min

    profiled = 5
    spec_hash = spec_profile_hash(LLMService.from_body(svc).spec, image)
    capacity = {
        "concurrencyPerReplica": profiled,
        "specHash": spec_hash,
        "measuredAt": "2026-11-29T16:00:00Z",
    }
    devcluster.kubectl(
        "patch", "llms", name, "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"capacity": capacity}}),
    )  # fmt: skip
    expected = math.ceil(14 / profiled)  # 3
    wait_for(
        lambda: deployment_replicas(devcluster, ns, name) == expected, 60, f"Deployment resized to {expected}"
    )
    svc = get_json(devcluster, "llms", name, "-n", ns)
    assert svc["spec"]["replicas"] == expected
    sizing = svc["status"]["sizing"]
    assert (sizing["reason"], sizing["inputs"]["targetSource"]) == ("Sized", "profile")
    assert f"ceil(14 / {profiled} per replica (profile)) = {expected}" in sizing["formula"]
