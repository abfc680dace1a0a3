"""router.mode inferencePool on the local control plane, with the real InferencePool CRD.

The CRD is the Gateway API Inference Extension's own v1.6.0 file
(``tests/operator/handlers/crds/``, unmodified), so the API server validates the operator's
pool against the upstream schema and its CEL rules. Replicas are real `plimsoll serve`
processes on a tiny model (the devcluster pod runner), so Ready means their /ready
answered. No gateway or endpoint picker runs here: nothing sets the pool's
``status.parents`` beyond the CRD's own default, so "accepted" means the API server
stored the object as built; what a picker would see is checked directly: the pods
the pool's selector matches, and the vllm: series on their /metrics.
"""

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from llms_k8s import apply, condition, get_json, llmservice, wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(420)]

CRD = Path(__file__).parent / "crds" / "inferencepools.inference.networking.k8s.io.yaml"
PICKER_SERIES = {
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
}


@pytest.fixture(scope="module")
def inference_pool_crd(devcluster: Any) -> None:
    devcluster.kubectl("apply", "-f", str(CRD))
    devcluster.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/inferencepools.inference.networking.k8s.io",
        "--timeout=60s",
    )


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from plimsoll.runtime.testing import pod_model

    return pod_model()


def _selected_ready(cluster: Any, ns: str, pool: dict[str, Any]) -> list[str]:
    """Names of the Ready pods the pool's selector matches (what an endpoint picker would use)."""
    selector = ",".join(f"{k}={v}" for k, v in sorted(pool["spec"]["selector"]["matchLabels"].items()))
    pods = (get_json(cluster, "pods", "-n", ns, "-l", selector) or {}).get("items", [])
    return sorted(
        p["metadata"]["name"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and (condition(p, "Ready") or {}).get("status") == "True"
    )


def _ready_replicas(cluster: Any, ns: str, name: str, want: int) -> dict[str, Any] | None:
    obj = get_json(cluster, "llms", name, "-n", ns)
    status = (obj or {}).get("status") or {}
    if (condition(obj, "Ready") or {}).get("status") == "True" and status.get("readyReplicas") == want:
        return dict(obj)
    return None


def test_pool_selects_exactly_the_ready_replicas_and_follows_scaling(
    devcluster: Any, llms_namespace: str, inference_pool_crd: None, tiny_model: Path
) -> None:
    ns, name = llms_namespace, "pooled"
    apply(
        devcluster,
        ns,
        llmservice(
            name,
            model={"uri": f"file://{tiny_model}"},
            replicas=2,
            engine={"maxNumSeqs": 2},
            podAnnotations={},  # real replicas
            router={"mode": "inferencePool", "endpointPickerRef": {"name": f"{name}-epp"}},
        ),
    )
    pool = wait_for(lambda: get_json(devcluster, "inferencepool", name, "-n", ns), 60, "the InferencePool")
    assert [o["kind"] for o in pool["metadata"]["ownerReferences"]] == ["LLMService"]
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",  # the upstream CRD's default, filled in by the API server
        "kind": "Service",
        "name": f"{name}-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }

    # A pod with the service's name label but not a replica (e.g. a benchmark pod) stays out.
    decoy = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-decoy",
            "labels": {"plimsoll.dev/llmservice": name, "app.kubernetes.io/instance": name},
            "annotations": {"plimsoll.dev/run-locally": "false"},
        },
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    devcluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(decoy))

    obj = wait_for(lambda: _ready_replicas(devcluster, ns, name, 2), 180, "2 Ready replicas", interval=1)
    replica_pods = sorted(
        p["metadata"]["name"]
        for p in get_json(devcluster, "pods", "-n", ns, "-l", obj["status"]["selector"])["items"]
        if (condition(p, "Ready") or {}).get("status") == "True"
    )
    assert _selected_ready(devcluster, ns, pool) == replica_pods and len(replica_pods) == 2

    # What the picker reads: the model-server protocol's series, under vLLM's names and types.
    pod = get_json(devcluster, "pod", replica_pods[0], "-n", ns)
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--metrics-compat") + 1] == "vllm"
    text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10).text
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert {n: types.get(n) for n in PICKER_SERIES} == PICKER_SERIES
    info = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info")
    assert {"block_size", "num_gpu_blocks"} <= set(info.samples[0].labels)

    # Scaling: the pool follows without being rewritten (its selector is the Deployment's).
    version = pool["metadata"]["resourceVersion"]
    devcluster.kubectl("patch", "llms", name, "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":3}}')
    wait_for(
        lambda: len(_selected_ready(devcluster, ns, pool)) == 3, 180, "3 Ready pods in the pool", interval=1
    )
    devcluster.kubectl("patch", "llms", name, "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":1}}')
    wait_for(
        lambda: len(_selected_ready(devcluster, ns, pool)) == 1, 180, "1 Ready pod in the pool", interval=1
    )
    assert get_json(devcluster, "inferencepool", name, "-n", ns)["metadata"]["resourceVersion"] == version

    # Leaving the mode takes the pool away (owner references alone would keep it until the LLMService goes).
    devcluster.kubectl(
        "patch",
        "llms",
        name,
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec":{"router":{"mode":"plimsoll","endpointPickerRef":null}}}',
    )
    wait_for(
        lambda: get_json(devcluster, "inferencepool", name, "-n", ns) is None, 60, "the InferencePool deleted"
    )
