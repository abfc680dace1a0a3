"""Hardware variants against a real kube-apiserver and the running test operator.

An LLMService with two variants (kwok-simulated pods, Manual per-variant targets):
the operator creates one Deployment per variant, labelled and selecting apart,
the replica planner sets each one's count (the cheapest start: one replica of
the cheap variant, none of the dear one) and explains it in ``status.variants``
(the router's weight) and ``status.mix``; once the pod serves its ``/metrics``
(``engines_k8s``, on its pod IP) the LLMService counts it Ready, in total and for
its variant; emptying ``spec.variants`` removes the variant Deployments.
"""

from typing import Any

import pytest
from engines_k8s import SimulatedEngines
from llms_k8s import apply, get_json, llmservice, wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]

NAME = "mixed"
VARIANTS = [
    {"name": "fast", "costPerHour": 4.0, "maxReplicas": 2, "concurrencyPerReplica": 8},
    {"name": "slow", "costPerHour": 1.0, "minReplicas": 1, "maxReplicas": 3, "concurrencyPerReplica": 2},
]


def deployments(cluster: Any, ns: str) -> dict[str, dict[str, Any]]:
    found = get_json(cluster, "deployments", "-n", ns, "-l", "plimsoll.dev/variant") or {}
    return {d["metadata"]["name"]: d for d in found.get("items", [])}


def test_one_deployment_per_variant_counts_from_the_planner_and_the_mix_in_status(
    devcluster: Any, llms_namespace: str
) -> None:
    ns = llms_namespace
    manifest = llmservice(
        NAME, variants=VARIANTS,
        autoscaling={"mode": "builtin", "intervalSeconds": 2},
        # Until the engines below serve /metrics the pods are silent: never count that as a reclaim.
        mix={"unschedulableSeconds": 3600},
    )  # fmt: skip
    del manifest["spec"]["replicas"]
    with SimulatedEngines(devcluster, ns, NAME):
        apply(devcluster, ns, manifest)
        check_variants(devcluster, ns)

    manifest["spec"]["variants"] = []
    manifest["spec"]["replicas"] = 1
    apply(devcluster, ns, manifest)
    wait_for(lambda: not deployments(devcluster, ns), 120, "the variant Deployments removed")


def check_variants(devcluster: Any, ns: str) -> None:
    both = wait_for(
        lambda: (d := deployments(devcluster, ns)) and {"mixed-fast", "mixed-slow"} <= set(d) and d,
        120, "a Deployment per variant",
    )  # fmt: skip
    for variant in ("fast", "slow"):
        spec = both[f"{NAME}-{variant}"]["spec"]
        assert spec["selector"]["matchLabels"]["plimsoll.dev/variant"] == variant
        assert spec["template"]["metadata"]["labels"]["plimsoll.dev/llmservice"] == NAME
    counts = wait_for(
        lambda: {n: d["spec"].get("replicas") for n, d in deployments(devcluster, ns).items()}
        if all(d["spec"].get("replicas") is not None for d in deployments(devcluster, ns).values()) else None,
        120, "the planner's counts on both Deployments",
    )  # fmt: skip
    assert counts == {"mixed-fast": 0, "mixed-slow": 1}
    status = wait_for(
        lambda: (s := (get_json(devcluster, "llms", NAME, "-n", ns) or {}).get("status") or {}).get("mix") and s,
        120, "status.mix",
    )  # fmt: skip
    assert status["variants"]["slow"]["weight"] == 2 and status["variants"]["fast"]["weight"] == 8
    assert status["mix"]["unit"] == "in-flight requests" and status["mix"]["reason"]

    # The slow variant's pod Ready and answering its scrape: counted in total and for its variant.
    # (Silent, the planner would count it as carrying nothing and add a fast replica for the floor.)
    seen: dict[str, Any] = {}

    def one_ready() -> dict[str, Any] | None:
        s = (get_json(devcluster, "llms", NAME, "-n", ns) or {}).get("status") or {}
        slow = (s.get("variants") or {}).get("slow") or {}
        seen.update(s)
        return s if s.get("readyReplicas") == 1 and slow.get("readyReplicas") == 1 else None

    try:
        ready = wait_for(one_ready, 120, "status.readyReplicas 1 and status.variants.slow.readyReplicas 1")
    except BaseException:
        keys = ("replicas", "readyReplicas", "variants", "mix")
        print({k: seen.get(k) for k in keys}, {n: d.get("status") for n, d in deployments(devcluster, ns).items()})
        raise
    assert ready["replicas"] == 1 and ready["variants"]["fast"]["readyReplicas"] == 0
    assert ready["variants"]["slow"]["rate"] == 2  # Manual: the router's share, in in-flight units
    counts = {n: d["spec"].get("replicas") for n, d in deployments(devcluster, ns).items()}
    assert counts == {"mixed-fast": 0, "mixed-slow": 1}
