"""autoscaling.mode hpa / keda on the local control plane.

The API server must accept the HorizontalPodAutoscaler the operator creates; the
control plane's own HPA controller must write a count through the LLMService
scale subresource (bounds-driven: this control plane has no metrics API), the
Deployment must run that count and reconcile must never reset it; switching the
mode back must remove the HPA. For keda: without the KEDA CRD a condition and a Warning say so;
once a (minimal) ScaledObject CRD exists the operator creates the ScaledObject.
"""

from pathlib import Path
from typing import Any

import pytest
import yaml
from llms_k8s import apply, condition, get_json, llmservice, wait_for, wait_for_passes

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.local import OperatorProcess
from plimsoll.operator.resources.external_autoscaler import build_hpa

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "llmservice-hpa.yaml"
SCALED_OBJECT_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "scaledobjects.keda.sh"},
    "spec": {
        "group": "keda.sh",
        "scope": "Namespaced",
        "names": {
            "kind": "ScaledObject",
            "plural": "scaledobjects",
            "singular": "scaledobject",
            "listKind": "ScaledObjectList",
        },
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


def external(name: str, mode: str, **autoscaling: Any) -> dict[str, Any]:
    manifest = llmservice(
        name,
        scaling={"min": 1, "max": 4},
        autoscaling={"mode": mode, **autoscaling},
        capacity={"mode": "Manual", "concurrencyPerReplica": 4},
    )
    del manifest["spec"]["replicas"]
    return manifest


def deployment_replicas(cluster: Any, ns: str, name: str) -> int | None:
    deployment = get_json(cluster, "deployment", name, "-n", ns)
    return None if deployment is None else int(deployment["spec"]["replicas"])


def test_hpa_is_accepted_targets_the_llmservice_and_never_fights_reconcile(
    devcluster: Any, llms_namespace: str, running_operator: OperatorProcess
) -> None:
    ns, name = llms_namespace, "hpa"
    apply(devcluster, ns, external(name, "hpa"))

    hpa = wait_for(lambda: get_json(devcluster, "hpa", name, "-n", ns), 60, "the HPA")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "plimsoll.dev/v1alpha1",
        "kind": "LLMService",
        "name": name,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "plimsoll_requests_in_flight"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "4"}
    svc = get_json(devcluster, "llms", name, "-n", ns)
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
    assert svc["spec"]["replicas"] == 1, "seeded so the HPA has a count to scale from"
    c = wait_for(
        lambda: condition(get_json(devcluster, "llms", name, "-n", ns), "ScalingLimited"), 30, "condition"
    )
    assert (c["status"], c["reason"]) == ("False", "ExternalAutoscaler")

    # The control plane's own HPA controller writes through the LLMService's scale subresource. It has
    # no metrics API here, so make it act on bounds alone: raise the HPA's minReplicas to 2 by hand
    # (reconcile puts 1 back on its next pass, so repeat until the controller got there first).
    def hpa_controller_wrote_two() -> bool:
        if get_json(devcluster, "llms", name, "-n", ns)["spec"]["replicas"] == 2:
            return True
        devcluster.kubectl("patch", "hpa", name, "-n", ns, "--type=merge", "-p", '{"spec":{"minReplicas":2}}')
        return False

    wait_for(hpa_controller_wrote_two, 120, "the HPA controller writing spec.replicas 2", interval=2)
    rescales = get_json(
        devcluster,
        "events",
        "-n",
        ns,
        "--field-selector",
        f"involvedObject.name={name},reason=SuccessfulRescale",
    )["items"]
    assert any(e["involvedObject"]["kind"] == "HorizontalPodAutoscaler" for e in rescales)
    wait_for(lambda: deployment_replicas(devcluster, ns, name) == 2, 60, "Deployment following the HPA")

    # Reconcile restores its HPA (minReplicas 1) but never resets the count the HPA wrote.
    wait_for(
        lambda: get_json(devcluster, "hpa", name, "-n", ns)["spec"]["minReplicas"] == 1, 30, "HPA restored"
    )

    def hpa_sees_two() -> bool:
        status = (get_json(devcluster, "hpa", name, "-n", ns) or {}).get("status") or {}
        return bool(status.get("currentReplicas") == 2)

    wait_for(hpa_sees_two, 60, "the HPA controller reading 2 replicas from the scale subresource")
    wait_for_passes(running_operator, "Timer 'resync_llmservice'", ns, name)  # two resyncs
    assert deployment_replicas(devcluster, ns, name) == 2
    assert get_json(devcluster, "llms", name, "-n", ns)["spec"]["replicas"] == 2

    # Back to the built-in loop: the HPA goes.
    devcluster.kubectl(
        "patch", "llms", name, "-n", ns, "--type=merge", "-p", '{"spec":{"autoscaling":{"mode":"builtin"}}}'
    )
    wait_for(lambda: get_json(devcluster, "hpa", name, "-n", ns) is None, 60, "the HPA deleted")


def test_hpa_example_and_its_hpa_pass_server_side_validation(devcluster: Any, llms_namespace: str) -> None:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["namespace"] = llms_namespace
    devcluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(body))
    hpa = build_hpa(LLMService.from_body(body), 8)
    devcluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(hpa))


def test_keda_waits_for_its_crd_then_gets_a_scaled_object(devcluster: Any, llms_namespace: str) -> None:
    ns, name = llms_namespace, "keda"
    assert devcluster.kubectl("get", "crd", "scaledobjects.keda.sh", check=False).returncode != 0
    apply(devcluster, ns, external(name, "keda", prometheusAddress="http://127.0.0.1:9090"))

    def limited_by(reason: str) -> dict[str, Any] | None:
        c = condition(get_json(devcluster, "llms", name, "-n", ns), "ScalingLimited")
        return c if c and c["reason"] == reason else None

    c = wait_for(lambda: limited_by("KedaNotInstalled"), 60, "ScalingLimited KedaNotInstalled")
    assert c["status"] == "True" and "install KEDA" in c["message"]
    warnings = get_json(
        devcluster,
        "events",
        "-n",
        ns,
        "--field-selector",
        f"involvedObject.name={name},reason=KedaNotInstalled",
    )["items"]
    assert warnings and warnings[0]["type"] == "Warning"

    devcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(SCALED_OBJECT_CRD))
    try:
        devcluster.kubectl(
            "wait", "--for=condition=Established", "crd/scaledobjects.keda.sh", "--timeout=60s"
        )
        obj = wait_for(
            lambda: get_json(devcluster, "scaledobjects.keda.sh", name, "-n", ns), 60, "the ScaledObject"
        )
        spec = obj["spec"]
        assert spec["scaleTargetRef"] == {
            "apiVersion": "plimsoll.dev/v1alpha1",
            "kind": "LLMService",
            "name": name,
        }
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "4"
        assert f'namespace="{ns}",llmservice="{name}"' in trigger["metadata"]["query"]
        wait_for(lambda: limited_by("ExternalAutoscaler"), 60, "ScalingLimited cleared")

        devcluster.kubectl(
            "patch", "llms", name, "-n", ns, "--type=merge", "-p", '{"spec":{"autoscaling":{"mode":"off"}}}'
        )
        wait_for(
            lambda: get_json(devcluster, "scaledobjects.keda.sh", name, "-n", ns) is None,
            60,
            "the ScaledObject deleted",
        )
        wait_for(lambda: limited_by("AutoscalingOff"), 60, "ScalingLimited handed back")
    finally:
        devcluster.kubectl("delete", "crd", "scaledobjects.keda.sh", "--wait=false", check=False)
