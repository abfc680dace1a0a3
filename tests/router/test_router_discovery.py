"""Replica discovery from an LLMService's pods: event handling (pure) and a watch on a real API server (k8s)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from plimsoll.router.backends import ReplicaSet
from plimsoll.router.config import RouterConfig
from plimsoll.router.discovery import PodDiscovery
from plimsoll.router.policy import PrefixAffinity

INSTANCE = "disc"


def pod(name: str, ip: str | None, ready: bool, component: str = "replica") -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {
        "metadata": {"name": name, "labels": {"app.kubernetes.io/instance": INSTANCE,
                                              "app.kubernetes.io/component": component}},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8123}]}]},
        "status": status,
    }


def test_a_split_services_pool_is_selected_by_its_role_across_both_deployments() -> None:
    """The prefill pool is its own Deployment (component prefill): a pool's selector is the instance and the role,
    never the service's status.selector (which is the decode Deployment's alone); nothing is read to build it."""
    for role in ("prefill", "decode"):
        discovery = PodDiscovery(RouterConfig(llmservice=INSTANCE), ReplicaSet(), role=role)
        selector = asyncio.run(discovery._selector(custom=None))
        assert selector == f"app.kubernetes.io/instance={INSTANCE},plimsoll.dev/role={role}"


def test_pod_events_update_the_replica_set_and_the_ring() -> None:
    replica_set = ReplicaSet()
    ring_rebuilds = []
    replica_set.on_change.append(lambda: ring_rebuilds.append(sorted(replica_set.replicas)))
    PrefixAffinity(replica_set, 8, 1.25)
    discovery = PodDiscovery(RouterConfig(llmservice=INSTANCE), replica_set)
    discovery._replace([pod("a", "127.1.0.5", True), pod("b", "127.1.0.6", False), pod("c", None, False)])
    assert {u: r.discovered_ready for u, r in replica_set.replicas.items()} == {
        "http://127.1.0.5:8123": True, "http://127.1.0.6:8123": False}
    discovery._apply("MODIFIED", pod("b", "127.1.0.6", True))
    assert replica_set.replicas["http://127.1.0.6:8123"].discovered_ready
    discovery._apply("ADDED", pod("c", "127.1.0.7", True))
    discovery._apply("DELETED", pod("a", "127.1.0.5", True))
    assert sorted(replica_set.replicas) == ["http://127.1.0.6:8123", "http://127.1.0.7:8123"]
    terminating = pod("b", "127.1.0.6", True)
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    discovery._apply("MODIFIED", terminating)
    assert sorted(replica_set.replicas) == ["http://127.1.0.7:8123"]
    assert ring_rebuilds[-1] == ["http://127.1.0.7:8123"]


@pytest.mark.k8s
@pytest.mark.slow
async def test_discovery_watches_pods_on_a_real_api_server(devcluster: Any) -> None:
    """Pods (simulated by kwok, loopback IPs) appear with their readiness; routers and deleted pods do not."""
    namespace = f"route-{uuid.uuid4().hex[:6]}"
    devcluster.kubectl("create", "namespace", namespace)
    try:
        for name, component in (("r1", "replica"), ("r2", "replica"), ("rt", "router")):
            manifest = pod(name, None, False, component)
            manifest.pop("status")
            manifest["apiVersion"], manifest["kind"] = "v1", "Pod"
            manifest["metadata"]["namespace"] = namespace
            # Not run as a process: kwok alone simulates it (Running, Ready, a 127.1/16 IP).
            manifest["metadata"]["annotations"] = {"plimsoll.dev/run-locally": "false"}
            manifest["spec"]["containers"][0]["image"] = "registry.invalid/engine:1"
            devcluster.apply(manifest)
        replica_set = ReplicaSet()
        discovery = PodDiscovery(
            RouterConfig(llmservice=INSTANCE, namespace=namespace, kubeconfig=str(devcluster.kubeconfig)),
            replica_set,
        )
        task = asyncio.create_task(discovery.run())

        async def until(predicate: Any, what: str) -> None:
            deadline = time.monotonic() + 60
            while not predicate():
                assert not task.done(), task.exception()
                assert time.monotonic() < deadline, f"timed out waiting for {what}: {replica_set.replicas}"
                await asyncio.sleep(0.2)

        def ready_urls() -> list[str]:
            return sorted(u for u, r in replica_set.replicas.items() if r.discovered_ready)

        try:
            await until(lambda: len(ready_urls()) == 2, "two ready replicas")
            pod_ips = devcluster.get_json("get", "pods", "-n", namespace, "-l",
                                          "app.kubernetes.io/component=replica")["items"]
            assert ready_urls() == sorted(f"http://{p['status']['podIP']}:8123" for p in pod_ips)
            assert all(u.startswith("http://127.") for u in ready_urls())
            devcluster.kubectl("delete", "pod", "r1", "-n", namespace, "--wait=false")
            await until(lambda: len(replica_set.replicas) == 1, "the deleted pod to leave")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        devcluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
