"""One status write per replica-planning tick, counted against a real kube-apiserver.

The tick is the handler's own (``ReplicaLoop.tick``: observe → plan → act →
write), run in this process with the operator's ``Kube`` client, whose calls a
thin subclass counts. The LLMService is stored with ``autoscaling.mode: off`` so
the session's running operator (reconcile: Deployment, kwok pods) follows
``spec.replicas`` but never plans it; each tick reads the stored object and
plans it as ``builtin``. The replicas' ``/metrics`` are served on their pod IPs
(``engines_k8s``). Through a steady load, a scale-up, a scale-down's drain and
its end, every tick makes at most one status write, and exactly one whenever it
planned something a reader must see; the drained pods are the ones the
ReplicaSet removes.
"""

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from engines_k8s import SimulatedEngines
from llms_k8s import apply, get_json, llmservice, wait_for

from plimsoll.operator.api.base import API_VERSION, KIND
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.replica_planning import ReplicaLoop
from plimsoll.operator.scaling.replica_plan import Plan

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(300)]

NAME = "onewrite"
TARGET = 4


@dataclass
class CountingKube(Kube):
    """The operator's client, counting what it sends: status patches that landed, and every other write."""

    writes: Counter[str] = field(default_factory=Counter)

    async def patch_status(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        result = await super().patch_status(*args, **kwargs)
        self.writes["status"] += 1  # counted once the API server took it (a 409 raises before this)
        return result

    async def merge_patch(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        self.writes[f"patch {kind}"] += 1
        return await super().merge_patch(api_version, kind, namespace, name, patch)


@dataclass
class Tick:
    what: str
    plan: Plan
    writes: Counter[str]


def pods(cluster: Any, ns: str) -> dict[str, dict[str, Any]]:
    found = get_json(cluster, "pods", "-n", ns, "-l", f"plimsoll.dev/llmservice={NAME}") or {}
    return {p["metadata"]["name"]: p for p in found.get("items", [])}


def staying(cluster: Any, ns: str) -> set[str]:
    return {name for name, p in pods(cluster, ns).items() if not p["metadata"].get("deletionTimestamp")}


def ready(cluster: Any, ns: str) -> set[str]:
    return {
        name
        for name, p in pods(cluster, ns).items()
        if not p["metadata"].get("deletionTimestamp")
        and p.get("status", {}).get("podIP")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
    }


async def test_each_tick_writes_status_at_most_once(devcluster: Any, llms_namespace: str) -> None:
    ns = llms_namespace
    apply(devcluster, ns, llmservice(
        NAME, replicas=1, scaling={"min": 1, "max": 3, "drainSeconds": 60},
        capacity={"mode": "Manual", "concurrencyPerReplica": TARGET},
        # Stored as off: the running operator only follows spec.replicas; these ticks plan it.
        autoscaling={"mode": "off", "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 0},
    ))  # fmt: skip
    wait_for(lambda: len(ready(devcluster, ns)) == 1, 120, "the first replica Ready")
    base = await Kube.connect(str(devcluster.kubeconfig))
    kube = CountingKube(api=base.api, _discovery={})
    engines = SimulatedEngines(devcluster, ns, NAME)
    events: list[tuple[str, str, str]] = []
    ticks: list[Tick] = []
    try:
        async with httpx.AsyncClient() as http:
            loop = ReplicaLoop(kube, http, lambda *e: events.append(e), logging.getLogger("test"))

            async def tick(what: str, load: float) -> Tick:
                engines.total = load
                engines.sync()
                body = await kube.get(API_VERSION, KIND, ns, NAME)
                assert body is not None
                body["spec"]["autoscaling"]["mode"] = "builtin"
                kube.writes.clear()
                plan = await loop.tick(body)
                assert plan is not None
                ticks.append(Tick(what, plan, Counter(kube.writes)))
                return ticks[-1]

            first = await tick("first look, on target", 4)
            assert first.writes["status"] == 1
            assert (await tick("unchanged", 4)).writes["status"] == 0  # refreshed at most every 15 s

            up = await tick("load step: 1 → 3", 12)
            assert [c.desired for c in up.plan.changes()] == [3]
            assert up.writes == Counter({"status": 1, "patch LLMService": 1})
            wait_for(lambda: len(ready(devcluster, ns)) == 3, 120, "3 replicas Ready")

            down = await tick("load drops: drain two", 2)
            victims = set(down.plan.drained())
            assert len(victims) == 2 and not down.plan.changes()
            assert down.writes == Counter({"status": 1, "patch Pod": 2})

            done = await tick("drained: 3 → 1", 2)
            assert [c.desired for c in done.plan.changes()] == [1]
            assert done.writes["status"] == 1 and done.writes["patch LLMService"] == 1
            kept = set(pods(devcluster, ns)) - victims
            wait_for(lambda: staying(devcluster, ns) == kept, 120, "the ReplicaSet removing the drained pods")
            await tick("after", 2)
    finally:
        engines.close()
        await base.close()

    for t in ticks:
        print(f"{t.what:28} {dict(t.writes)}  {[e.reason for e in t.plan.events]}")
    assert all(t.writes["status"] <= 1 for t in ticks), [(t.what, t.writes) for t in ticks]
    # Whatever the plan said a reader must see was written, in that one write.
    assert all(t.writes["status"] == (t.plan.status is not None) for t in ticks)
    assert {"ScaledUp", "DrainStarted", "ScaledDown"} <= {reason for _, reason, _ in events}
    stored = get_json(devcluster, "llms", NAME, "-n", ns)["status"]
    assert stored["scaleDown"]["reason"] == "Drained" and sorted(stored["scaleDown"]["lastPods"]) == sorted(
        victims
    )
