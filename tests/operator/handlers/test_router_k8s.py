"""The operator deploys the router in front of real replicas, and takes it away again.

Replicas run `plimsoll serve` on a tiny random model, and the router pod runs
`plimsoll route --llmservice` with its own ServiceAccount token, all as local
processes bound to their pod IPs (the devcluster pod runner). The operator runs
with the chart's RBAC (``running_operator``), so creating the router's Role also
proves the chart grants everything that Role grants. Completions go to the
router POD's loopback IP through the official ``openai`` client; Service cluster
IPs are never contacted.
"""

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for

from plimsoll.router.proxy import REPLICA_HEADER

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(300)]

ROUTER_KINDS = ("serviceaccount", "role", "rolebinding", "deployment", "service")


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The tiny random model for pods the pod runner starts (see ``pod_model``)."""
    from plimsoll.runtime.testing import pod_model

    return pod_model()


def _pods(cluster: Any, ns: str, component: str) -> list[dict[str, Any]]:
    found = get_json(cluster, "pods", "-n", ns, "-l", f"app.kubernetes.io/component={component}")
    return list((found or {}).get("items", []))


def _ready_ips(pods: list[dict[str, Any]]) -> list[str]:
    return [
        p["status"]["podIP"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and (condition(p, "Ready") or {}).get("status") == "True"
    ]


def _served(cluster: Any, ns: str, name: str, endpoint: str) -> dict[str, Any] | None:
    obj = get_json(cluster, "llms", name, "-n", ns)
    ready = condition(obj, "Ready")
    status = (obj or {}).get("status") or {}
    generation = (obj or {}).get("metadata", {}).get("generation")
    if ready and ready["status"] == "True" and status.get("endpoint") == endpoint:
        return dict(obj) if status.get("observedGeneration") == generation else None
    return None


def test_router_is_deployed_in_front_of_real_replicas_and_removed_when_disabled(
    devcluster: Any, llms_namespace: str, tiny_model: Path
) -> None:
    ns, name = llms_namespace, "routed"
    manifest = llmservice(
        name,
        model={"uri": f"file://{tiny_model}"},
        replicas=2,
        engine={"maxNumSeqs": 2},
        podAnnotations={},  # run replicas and router for real
        router={"enabled": True, "policy": "least-in-flight"},
    )
    started = time.monotonic()
    apply(devcluster, ns, manifest)

    router_url = f"http://{name}-router.{ns}.svc:8000/v1"
    obj = wait_for(
        lambda: _served(devcluster, ns, name, router_url), 150, "Ready=True via the router", interval=1
    )
    assert obj["status"]["readyReplicas"] == 2, obj["status"]
    for kind in ROUTER_KINDS:
        child = get_json(devcluster, kind, f"{name}-router", "-n", ns)
        assert child is not None, f"no {kind} {name}-router"
        owners = child["metadata"].get("ownerReferences") or []
        assert [o["kind"] for o in owners] == ["LLMService"], f"{kind} is not owned by the LLMService"
    role = get_json(devcluster, "role", f"{name}-router", "-n", ns)
    assert {tuple(r["verbs"]) for r in role["rules"]} == {("get",), ("list", "watch")}

    # Ready waits for the router too: its pod ran through the pod runner and passed /ready
    # (which needs a discovered ready replica), so the endpoint in status answers.
    assert get_json(devcluster, "deployment", f"{name}-router", "-n", ns)["status"]["readyReplicas"] == 1
    router_ips = wait_for(lambda: _ready_ips(_pods(devcluster, ns, "router")), 10, "a ready router pod")
    replica_ips = _ready_ips(_pods(devcluster, ns, "replica"))
    assert len(replica_ips) == 2 and not set(router_ips) & set(replica_ips)
    print(
        f"\nrouter and 2 replicas Ready after {time.monotonic() - started:.0f} s; router pod {router_ips[0]}"
    )

    # Discovery may trail the pods' Ready by one watch event: wait for the router to list both.
    replica_urls = {f"http://{ip}:8000" for ip in replica_ips}

    def both_replicas_known() -> bool:
        ready = httpx.get(f"http://{router_ips[0]}:8000/ready", timeout=5, trust_env=False).json()
        return bool(ready["ready_replicas"] == len(replica_urls))  # counts: /ready names no pod address

    wait_for(both_replicas_known, 30, "the router to discover both replicas")

    with httpx.Client(trust_env=False, timeout=60) as http:
        client = openai.OpenAI(base_url=f"http://{router_ips[0]}:8000/v1", api_key="none", http_client=http)
        answered_by: set[str] = set()
        for i in range(4):
            raw = client.completions.with_raw_response.create(
                model=name, prompt=f"request {i}: hello", max_tokens=4, temperature=0
            )
            completion = raw.parse()
            assert completion.choices[0].text and completion.usage and completion.usage.completion_tokens >= 1
            answered_by.add(raw.headers[REPLICA_HEADER])
    # Every answer came from a replica pod, never from anything else behind the router.
    assert answered_by <= replica_urls, answered_by

    # Router off: its objects go, and the endpoint points back at the replicas' Service.
    devcluster.kubectl(
        "patch",
        "llms",
        name,
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"router": {"enabled": False}}}),
    )
    turned_off = time.monotonic()
    wait_for(
        lambda: _served(devcluster, ns, name, f"http://{name}.{ns}.svc:8000/v1"),
        30,
        "endpoint back on replicas",
    )

    def router_gone() -> bool:
        return all(get_json(devcluster, kind, f"{name}-router", "-n", ns) is None for kind in ROUTER_KINDS)

    wait_for(router_gone, 30, "the router objects to be deleted")
    print(f"router removed {time.monotonic() - turned_off:.1f} s after router.enabled=false")
    events = get_json(devcluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")
    deleted = " ".join(e["message"] for e in (events or {}).get("items", []) if e.get("reason") == "Deleted")
    for kind in ("ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"):
        assert f"{kind}/{name}-router" in deleted, f"no Deleted Event names {kind}: {deleted!r}"
    # The replicas were left alone.
    assert len(_ready_ips(_pods(devcluster, ns, "replica"))) == 2
