"""A split LLMService on the local control plane: two pools, the router in front, and back to one pool.

Replica pods are simulated (kwok makes them Ready); the router pod runs for real through the pod runner.
The operator runs with the chart's RBAC, so the prefill pool's Deployment, its deletion and the status
writes all go through the permissions users install.
"""

import json
from typing import Any

import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]

ROLE_LABEL = "plimsoll.dev/role"


def _pods(cluster: Any, ns: str, selector: str) -> list[dict[str, Any]]:
    found = get_json(cluster, "pods", "-n", ns, "-l", selector)
    return [p for p in (found or {}).get("items", []) if not p["metadata"].get("deletionTimestamp")]


def _args(deployment: dict[str, Any]) -> list[str]:
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def _role(args: list[str]) -> str:
    role: str = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_role"]
    return role


def test_two_pools_become_ready_behind_the_router_and_go_when_the_split_does(
    devcluster: Any, llms_namespace: str
) -> None:
    ns, name = llms_namespace, "split"
    manifest = llmservice(name, replicas=2, disaggregation={"prefill": {"replicas": 1, "min": 1, "max": 2}})
    apply(devcluster, ns, manifest)

    def both_ready() -> dict[str, Any] | None:
        obj = get_json(devcluster, "llms", name, "-n", ns)
        split = ((obj or {}).get("status") or {}).get("disaggregation") or {}
        ready = (split.get("prefill") or {}).get("readyReplicas") == 1 and (split.get("decode") or {}).get(
            "readyReplicas"
        ) == 2
        return obj if ready and (condition(obj, "Ready") or {}).get("status") == "True" else None

    obj = wait_for(both_ready, 150, "both pools Ready and the service Ready=True")
    assert obj["status"]["disaggregation"]["ratio"] == "1P:2D"
    assert obj["status"]["disaggregation"]["runs"] == "split"

    prefill = get_json(devcluster, "deployment", f"{name}-prefill", "-n", ns)
    decode = get_json(devcluster, "deployment", name, "-n", ns)
    assert prefill["metadata"]["ownerReferences"][0]["name"] == name
    assert (_role(_args(prefill)), _role(_args(decode))) == ("kv_producer", "kv_consumer")
    assert len(_pods(devcluster, ns, f"app.kubernetes.io/instance={name},{ROLE_LABEL}=prefill")) == 1
    assert len(_pods(devcluster, ns, f"app.kubernetes.io/instance={name},{ROLE_LABEL}=decode")) == 2
    router = get_json(devcluster, "deployment", f"{name}-router", "-n", ns)
    assert "--disaggregated" in _args(router)

    # No longer split: the prefill pool goes, the decode pool stays as the service's replicas.
    devcluster.kubectl(
        "patch", "llms", name, "-n", ns, "--type=json",
        "-p", json.dumps([{"op": "remove", "path": "/spec/disaggregation"}]),
    )  # fmt: skip
    wait_for(
        lambda: get_json(devcluster, "deployment", f"{name}-prefill", "-n", ns) is None,
        60,
        "the prefill pool's Deployment to be deleted",
    )

    def one_pool() -> dict[str, Any] | None:
        obj = get_json(devcluster, "llms", name, "-n", ns)
        status = (obj or {}).get("status") or {}
        current = status.get("observedGeneration") == (obj or {}).get("metadata", {}).get("generation")
        return obj if current and status.get("disaggregation") is None else None

    wait_for(one_pool, 60, "status.disaggregation cleared for the current generation")
    assert "--kv-transfer-config" not in _args(get_json(devcluster, "deployment", name, "-n", ns))
