"""Multi-node replicas on the local control plane: InvalidSpec without the LWS API, a LeaderWorkerSet with it.

The CRD is kubernetes-sigs/lws's own (``tests/operator/handlers/crds/``, descriptions
stripped, schema unchanged), so the API server validates the operator's object
against the upstream schema (server-side apply would refuse a field it lacks). No
LWS controller runs here, so no pods appear: "accepted" means the API server
stored the object as built.
The same LLMService first meets a cluster without the API (InvalidSpec saying
what to install, one Warning Event, no child) and then, with no spec edit, gets
its LeaderWorkerSet once the CRD is installed.
"""

from pathlib import Path
from typing import Any

import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(300)]

CRD = Path(__file__).parent / "crds" / "leaderworkersets.leaderworkerset.x-k8s.io.yaml"
CRD_NAME = "crd/leaderworkersets.leaderworkerset.x-k8s.io"


@pytest.fixture
def no_lws_api(devcluster: Any) -> Any:
    devcluster.kubectl("delete", CRD_NAME, "--ignore-not-found", "--wait=true")
    yield
    devcluster.kubectl("delete", CRD_NAME, "--ignore-not-found", "--wait=true")


def _events(cluster: Any, ns: str, name: str, reason: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")
    return [e for e in (items or {}).get("items", []) if e.get("reason") == reason]


def test_multi_node_replicas_wait_for_the_lws_api_then_become_a_leader_worker_set(
    devcluster: Any, llms_namespace: str, no_lws_api: None
) -> None:
    ns, name = llms_namespace, "wide"
    manifest = llmservice(
        name,
        model={"uri": "hf://org/wide-model"},
        engine={"kind": "vllm"},
        resources={"nodes": 2, "gpu": {"count": 8}},
        replicas=2,
    )
    apply(devcluster, ns, manifest)

    def invalid() -> dict[str, Any] | None:
        ready = condition(get_json(devcluster, "llms", name, "-n", ns), "Ready")
        return ready if ready and ready["reason"] == "InvalidSpec" else None

    ready = wait_for(invalid, 60, "Ready=False, reason InvalidSpec")
    assert "leaderworkersets.leaderworkerset.x-k8s.io is not served" in ready["message"]
    assert "kubernetes-sigs/lws" in ready["message"]
    assert wait_for(lambda: _events(devcluster, ns, name, "InvalidSpec"), 30, "an InvalidSpec Event")
    assert get_json(devcluster, "deployment", name, "-n", ns) is None  # no replicas of the wrong shape

    devcluster.kubectl("apply", "--server-side", "-f", str(CRD))
    wait_for(  # `kubectl wait` fails while the new CRD has no conditions at all
        lambda: (condition(get_json(devcluster, CRD_NAME), "Established") or {}).get("status") == "True",
        60,
        "the LWS CRD Established",
    )
    lws = wait_for(
        lambda: get_json(devcluster, "leaderworkersets.leaderworkerset.x-k8s.io", name, "-n", ns),
        90,
        "the LeaderWorkerSet, after the CRD was installed (no spec edit)",
    )
    assert len(_events(devcluster, ns, name, "InvalidSpec")) == 1  # said once, not in a loop
    spec = lws["spec"]
    assert spec["replicas"] == 2 and spec["leaderWorkerTemplate"]["size"] == 2
    assert lws["metadata"]["ownerReferences"][0]["name"] == name
    leader = spec["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    worker = spec["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert "--pipeline-parallel-size 2" in leader["args"][0] and "--tensor-parallel-size 8" in leader["args"][0]
    assert "$LWS_LEADER_ADDRESS" in worker["args"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] in (8, "8")
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"

    # Back to one node: the LeaderWorkerSet goes, a Deployment takes its place.
    devcluster.kubectl(
        "patch", "llms", name, "-n", ns, "--type=merge",
        "-p", '{"spec": {"resources": {"nodes": 1}}}',
    )  # fmt: skip
    wait_for(lambda: get_json(devcluster, "deployment", name, "-n", ns), 60, "the Deployment for one node")
    wait_for(
        lambda: get_json(devcluster, "leaderworkersets.leaderworkerset.x-k8s.io", name, "-n", ns) is None,
        60,
        "the LeaderWorkerSet deleted",
    )


def test_plimsoll_across_nodes_is_refused_by_the_api_server(devcluster: Any, llms_namespace: str) -> None:
    manifest = llmservice("wide-plimsoll", resources={"nodes": 2, "gpu": {"count": 0}})
    result = apply(devcluster, llms_namespace, manifest, check=False)
    assert result.returncode != 0
    assert "resources.nodes above 1 needs resources.gpu.count of at least 1" in result.stderr
