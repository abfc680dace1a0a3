"""Acceptance tests of the local control plane: scheduling onto simulated GPU
nodes, loopback pod IPs, FailedScheduling, garbage collection, CRD subresources."""

import ipaddress
import json
from typing import Any

import pytest
import yaml

from plimsoll.devcluster import paths
from plimsoll.devcluster.cluster import Cluster, wait_until

pytestmark = pytest.mark.k8s

# Not a plimsoll image: kwok simulates these pods (the pod runner leaves them alone).
PAUSE = "registry.k8s.io/pause:3.10"


def _gpu_deployment(name: str, replicas: int, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": PAUSE,
                            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                        }
                    ]
                },
            },
        },
    }


def _apply(cluster: Cluster, ns: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(obj))


def _ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def test_versions_and_loopback_service_range(devcluster: Cluster) -> None:
    version = json.loads(devcluster.kubectl("version", "-o", "json").stdout)
    assert version["clientVersion"]["gitVersion"] == f"v{paths.K8S_VERSION}"
    assert version["serverVersion"]["gitVersion"] == f"v{paths.K8S_VERSION}"
    svc = devcluster.get_json("service", "kubernetes", "-n", "default")
    assert ipaddress.ip_address(svc["spec"]["clusterIP"]).is_loopback


def test_simulated_gpu_nodes_are_ready_with_their_gpus(devcluster: Cluster) -> None:
    nodes = {n["metadata"]["name"]: n for n in devcluster.get_json("nodes")["items"]}
    assert {n.name for n in devcluster.nodes} <= set(nodes)
    for node in devcluster.nodes:
        status = nodes[node.name]["status"]
        assert status["allocatable"]["nvidia.com/gpu"] == str(node.gpus)
        assert _ready(nodes[node.name])
        assert not nodes[node.name]["spec"].get("taints"), "pods must not need tolerations"
    assert sorted(n.gpus for n in devcluster.nodes) == [2, 4]


def test_gpu_deployment_pods_are_scheduled_ready_with_loopback_ips(
    devcluster: Cluster, namespace: str
) -> None:
    _apply(devcluster, namespace, _gpu_deployment("gpu3", replicas=3, gpus=1))
    devcluster.kubectl("rollout", "status", "deployment/gpu3", "-n", namespace, "--timeout=90s")
    pods = devcluster.get_json("pods", "-n", namespace, "-l", "app=gpu3")["items"]
    assert len(pods) == 3
    gpu_nodes = {n.name for n in devcluster.nodes}
    for pod in pods:
        assert pod["spec"]["nodeName"] in gpu_nodes
        assert _ready(pod)
        assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(devcluster.pod_cidr)
    assert len({p["status"]["podIP"] for p in pods}) == 3, "pod IPs must be distinct"


def test_pod_needing_more_gpus_than_any_node_stays_pending(devcluster: Cluster, namespace: str) -> None:
    too_many = max(n.gpus for n in devcluster.nodes) + 1
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "greedy"},
        "spec": {
            "containers": [
                {"name": "main", "image": PAUSE, "resources": {"limits": {"nvidia.com/gpu": str(too_many)}}}
            ]
        },
    }
    _apply(devcluster, namespace, pod)

    def failed_scheduling() -> list[dict[str, Any]]:
        events = devcluster.get_json(
            "events",
            "-n",
            namespace,
            "--field-selector",
            "involvedObject.name=greedy,reason=FailedScheduling",
        )["items"]
        return list(events)

    events = wait_until(failed_scheduling, 60, "a FailedScheduling event for pod greedy")
    assert "nvidia.com/gpu" in events[0]["message"]
    got = devcluster.get_json("pod", "greedy", "-n", namespace)
    assert got["status"]["phase"] == "Pending"
    assert not got["spec"].get("nodeName")


def test_deleting_a_deployment_garbage_collects_replicasets_and_pods(
    devcluster: Cluster, namespace: str
) -> None:
    _apply(devcluster, namespace, _gpu_deployment("gc", replicas=2, gpus=1))
    devcluster.kubectl("rollout", "status", "deployment/gc", "-n", namespace, "--timeout=90s")
    assert devcluster.get_json("replicasets", "-n", namespace, "-l", "app=gc")["items"]
    devcluster.kubectl("delete", "deployment", "gc", "-n", namespace, "--wait=false")

    def all_gone() -> bool:
        rs = devcluster.get_json("replicasets", "-n", namespace, "-l", "app=gc")["items"]
        pods = devcluster.get_json("pods", "-n", namespace, "-l", "app=gc")["items"]
        return not rs and not pods

    wait_until(all_gone, 90, "the garbage collector to delete the ReplicaSet and its pods")


WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.plimsoll.dev"},
    "spec": {
        "group": "test.plimsoll.dev",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "shortNames": ["wdg"]},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {"replicas": {"type": "integer", "minimum": 0}},
                            },
                            "status": {
                                "type": "object",
                                "properties": {
                                    "replicas": {"type": "integer"},
                                    "selector": {"type": "string"},
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}


def test_crd_with_status_and_scale_subresources(devcluster: Cluster, namespace: str) -> None:
    devcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(WIDGET_CRD))
    devcluster.kubectl(
        "wait", "--for=condition=Established", "crd/widgets.test.plimsoll.dev", "--timeout=30s"
    )
    widget = {
        "apiVersion": "test.plimsoll.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "w"},
        "spec": {"replicas": 1},
    }
    _apply(devcluster, namespace, widget)

    devcluster.kubectl("scale", "wdg/w", "-n", namespace, "--replicas=3")
    assert devcluster.get_json("widget", "w", "-n", namespace)["spec"]["replicas"] == 3

    # status is a subresource: a plain update may not change it, the status patch does.
    devcluster.kubectl(
        "patch", "widget", "w", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"replicas": 3, "selector": "app=w"}}),
    )  # fmt: skip
    scale = devcluster.get_json("widget", "w", "-n", namespace, "--subresource=scale")
    assert scale["kind"] == "Scale"
    assert scale["spec"]["replicas"] == 3
    assert scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == "app=w"

    # The schema is enforced by the API server.
    bad = devcluster.kubectl("scale", "widget/w", "-n", namespace, "--replicas=-1", check=False)
    assert bad.returncode != 0


def test_status_reports_every_component_alive(devcluster: Cluster) -> None:
    attached = Cluster.load(devcluster.state_dir)
    statuses = attached.status()
    names = {s.name for s in statuses}
    assert {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"} <= names
    assert all(s.alive for s in statuses)
    assert attached.resident_memory() > 50 * 2**20
