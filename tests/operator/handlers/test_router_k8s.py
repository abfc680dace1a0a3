"""The operator deploys the router in front of real replicas, and takes it away again.

Replicas run `plimsoll serve` on a tiny random model, and the two router pods run
`plimsoll route --llmservice` with their own ServiceAccount token, all as local
processes bound to their pod IPs (the devcluster pod runner). The operator runs
with the chart's RBAC (``running_operator``), so creating the router's Role also
proves the chart grants everything that Role grants. Completions go to the
router PODs' loopback IPs through the official ``openai`` client (a client that
retries once on the other router stands in for the Service); Service cluster
IPs are never contacted. While both run: a stream whose replica process is
SIGKILLed completes with the uninterrupted tokens, and a router process SIGKILLed
costs a client that retries once nothing, the other router sending each prompt
where both sent it before.
"""

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for

from plimsoll.devcluster.podrunner import pod_processes
from plimsoll.prometheus import parse
from plimsoll.router.proxy import REPLICA_HEADER

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(300)]

ROUTER_KINDS = ("serviceaccount", "role", "rolebinding", "deployment", "poddisruptionbudget", "service")


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
        router={"enabled": True, "policy": "prefix-affinity"},
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
    router_ips = wait_for(
        lambda: (ips := _ready_ips(_pods(devcluster, ns, "router"))) and len(ips) == 2 and ips, 120,
        "both router pods ready",
    )  # fmt: skip
    replica_ips = _ready_ips(_pods(devcluster, ns, "replica"))
    assert len(replica_ips) == 2 and not set(router_ips) & set(replica_ips)
    print(
        f"\nrouter and 2 replicas Ready after {time.monotonic() - started:.0f} s; router pod {router_ips[0]}"
    )

    # Discovery may trail the pods' Ready by one watch event: wait for the routers to see both.
    replica_urls = {f"http://{ip}:8000" for ip in replica_ips}
    for ip in router_ips:
        wait_for(lambda ip=ip: _replicas_ready(ip) == 2, 30, f"router {ip} to see both replicas ready")

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
    _survive_a_replica_and_a_router(devcluster, ns, router_ips, replica_urls)

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
    for kind in ("ServiceAccount", "Role", "RoleBinding", "Deployment", "PodDisruptionBudget", "Service"):
        assert f"{kind}/{name}-router" in deleted, f"no Deleted Event names {kind}: {deleted!r}"
    # The replicas were left alone.
    assert len(_ready_ips(_pods(devcluster, ns, "replica"))) == 2


def _replicas_ready(router_ip: str) -> float:
    """Replicas the router at ``router_ip`` counts ready (its plimsoll_router_replica_ready gauges)."""
    text = httpx.get(f"http://{router_ip}:8000/metrics", timeout=5, trust_env=False).text
    return parse(text).sum("plimsoll_router_replica_ready") or 0.0


def _engine_pid(cluster: Any, ns: str, url: str, component: str, container: str) -> int:
    """The PID of ``container`` in the pod whose IP ``url`` names."""
    ip = url.removeprefix("http://").split(":")[0]
    pod = next(p for p in _pods(cluster, ns, component) if p["status"].get("podIP") == ip)
    records = pod_processes(Path(cluster.state_dir) / "pods", ns, pod["metadata"]["name"])
    return records[container].pid


def _stream(
    http: httpx.Client, router_ip: str, body: dict[str, Any], on_token: Any = None
) -> tuple[str, list[int]]:
    """One stream through a router: (the replica that began it, its token ids); fails unless it ends in [DONE]."""
    with http.stream("POST", f"http://{router_ip}:8000/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        ids: list[int] = []
        last = ""
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            last = line.removeprefix("data: ")
            if last != "[DONE]":
                chunk = json.loads(last)
                assert "error" not in chunk, chunk
                ids += [t for c in chunk["choices"] for t in c.get("token_ids", [])]
                if on_token is not None:
                    on_token(r.headers[REPLICA_HEADER], len(ids))
        assert last == "[DONE]"
        return r.headers[REPLICA_HEADER], ids


def _homes(http: httpx.Client, router_ip: str, prompts: list[str]) -> dict[str, str]:
    homes = {}
    for prompt in prompts:
        r = http.post(f"http://{router_ip}:8000/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        homes[prompt] = r.headers[REPLICA_HEADER]
    return homes


def _survive_a_replica_and_a_router(cluster: Any, ns: str, router_ips: list[str], replicas: set[str]) -> None:
    body = {"prompt": "carried on across a replica's death", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    prompts = [f"tenant {i:02d} system prompt, then a question" for i in range(12)]
    with httpx.Client(trust_env=False, timeout=120) as http:
        uninterrupted = http.post(f"{sorted(replicas)[0]}/v1/completions", json=body).json()
        want = uninterrupted["choices"][0]["token_ids"]
        before = _homes(http, router_ips[0], prompts)
        assert _homes(http, router_ips[1], prompts) == before  # two routers, one set, the same decisions
        killed: list[str] = []

        def kill_at_token_8(replica: str, tokens: int) -> None:
            if tokens >= 8 and not killed:
                os.kill(_engine_pid(cluster, ns, replica, "replica", "engine"), signal.SIGKILL)
                killed.append(replica)

        started_on, ids = _stream(http, router_ips[0], body, kill_at_token_8)
        assert killed == [started_on] and ids == want  # the same tokens as without the kill
        # SIGKILL a router: a client that retries once, on the other router, sees no failure.
        os.kill(_engine_pid(cluster, ns, f"http://{router_ips[0]}", "router", "router"), signal.SIGKILL)
        for i in range(4):
            try:
                _, ids = _stream(http, router_ips[0], body)
            except (httpx.HTTPError, AssertionError):
                _, ids = _stream(http, router_ips[1], body)
            assert ids == want, i
        # Once the killed replica is back, the surviving router sends each prompt where both did.
        wait_for(lambda: _replicas_ready(router_ips[1]) == 2, 120, "the killed replica ready again")
        assert _homes(http, router_ips[1], prompts) == before
