"""The operator against the local control plane, running with the chart's ServiceAccount permissions.

Replica pods are scheduled onto the simulated GPU nodes by the real scheduler and
made Ready by kwok; the operator sees them through the real Deployment controller.
"""

import ipaddress
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from llms_k8s import SIMULATED, apply, condition, get_json, llmservice, wait_for, wait_for_passes

from plimsoll.operator.local import OperatorProcess

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "llmservice-embedded.yaml"
GPU_NODES = {"gpu-node-a", "gpu-node-b"}


def ready(cluster: Any, ns: str, name: str, timeout: float = 90) -> dict[str, Any]:
    """Ready=True computed from the current spec: right after an edit the status still
    says Ready for the previous generation until the operator has reconciled the new one,
    so the status's observedGeneration must have caught up with metadata.generation."""

    def check() -> dict[str, Any] | None:
        obj = get_json(cluster, "llms", name, "-n", ns)
        c = condition(obj, "Ready")
        current = obj and obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"]
        return obj if c and c["status"] == "True" and current else None

    return dict(wait_for(check, timeout, f"LLMService {ns}/{name} Ready=True for its current generation"))


def events(cluster: Any, ns: str, name: str) -> list[dict[str, Any]]:
    items = get_json(
        cluster,
        "events",
        "-n",
        ns,
        "--field-selector",
        f"involvedObject.name={name},involvedObject.kind=LLMService",
    )
    return list((items or {}).get("items", []))


def test_example_reconciles_onto_gpu_nodes(devcluster: Any, llms_namespace: str) -> None:
    ns = llms_namespace
    example = yaml.safe_load(EXAMPLE.read_text())
    example["spec"]["podAnnotations"] = SIMULATED  # simulate the pod instead of running the engine
    apply(devcluster, ns, example)
    name = example["metadata"]["name"]
    svc = ready(devcluster, ns, name)

    deployment = get_json(devcluster, "deployment", name, "-n", ns)
    owner = deployment["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "LLMService",
        name,
        svc["metadata"]["uid"],
        True,
    )
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["args"][:2] == ["serve", "--host"]
    service = get_json(devcluster, "service", name, "-n", ns)
    assert service["spec"]["ports"][0]["port"] == 8000
    assert service["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
    pdb = get_json(devcluster, "pdb", name, "-n", ns)
    assert pdb["spec"]["maxUnavailable"] == 1

    # The replicas, by the selector the scale subresource publishes (a profiling Job's pod is not one).
    pods = get_json(devcluster, "pods", "-n", ns, "-l", svc["status"]["selector"])["items"]
    assert len(pods) == 1
    assert pods[0]["spec"]["nodeName"] in GPU_NODES
    # A loopback pod IP from the range this control plane claimed (127.1/16 unless another held it).
    assert ipaddress.ip_address(pods[0]["status"]["podIP"]) in ipaddress.ip_network(devcluster.pod_cidr)

    status = svc["status"]
    assert status["observedGeneration"] == svc["metadata"]["generation"]
    assert (status["replicas"], status["readyReplicas"]) == (1, 1)
    assert status["endpoint"] == f"http://{name}.{ns}.svc:8000/v1"
    assert {c["type"] for c in status["conditions"]} >= {"Ready", "Progressing", "Degraded"}
    # The example sets no objective: the interactive preset applies, and status and an Event say so.
    assert status["slo"]["ttftP95Ms"] == 3000 and status["slo"]["source"] == "preset:interactive"

    table = devcluster.kubectl("get", "llms", "-n", ns).stdout
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "READY", "REPLICAS", "CAPACITY", "AGE"]
    assert row.split()[:3] == [name, "True", "1"]
    assert devcluster.kubectl("get", "llms", "-A").returncode == 0
    # kopf posts Events from a background queue: they may trail the status they describe.
    wait_for(
        lambda: (
            {"Created", "AllReplicasReady", "SLODefaulted"}
            <= {e["reason"] for e in events(devcluster, ns, name)}
        ),
        30,
        "the Created, AllReplicasReady and SLODefaulted Events",
    )
    defaulted = [e for e in events(devcluster, ns, name) if e["reason"] == "SLODefaulted"]
    assert len(defaulted) == 1 and "interactive preset applies (ttftP95Ms 3000)" in defaulted[0]["message"]


INVALID = [
    (
        {"scaling": {"min": 3, "max": 2}, "autoscaling": {"mode": "builtin"}, "replicas": None},
        "scaling.min must not exceed scaling.max",
    ),
    ({"resources": {"gpu": {"count": -1}}}, "spec.resources.gpu.count"),
    ({"engine": {"kind": "tgi"}}, 'Unsupported value: "tgi"'),
    ({"model": {"uri": "s3://bucket/llama"}}, "spec.model.uri"),
]


@pytest.mark.parametrize(
    ("patch", "message"), INVALID, ids=["min>max", "negative-gpus", "unknown-engine", "bad-uri"]
)
def test_api_server_rejects_invalid_specs(
    devcluster: Any, llms_namespace: str, patch: dict[str, Any], message: str
) -> None:
    manifest = llmservice("bad")
    for key, value in patch.items():
        if value is None:
            manifest["spec"].pop(key, None)
        else:
            manifest["spec"][key] = value
    proc = apply(devcluster, llms_namespace, manifest, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_invalid_spec_past_the_schema_gets_invalid_spec_without_retry_storm(
    devcluster: Any, llms_namespace: str, running_operator: OperatorProcess
) -> None:
    ns = llms_namespace
    # vLLM cannot serve the embedded model: the schema allows it, the operator refuses it.
    apply(devcluster, ns, llmservice("vllm-embedded", engine={"kind": "vllm"}))
    apply(devcluster, ns, llmservice("good"))

    def invalid() -> dict[str, Any] | None:
        c = condition(get_json(devcluster, "llms", "vllm-embedded", "-n", ns), "Ready")
        return c if c and c["reason"] == "InvalidSpec" else None

    c = wait_for(invalid, 60, "Ready=False InvalidSpec")
    assert c["status"] == "False"
    assert "engine.kind vllm cannot serve embedded://" in c["message"]
    ready(devcluster, ns, "good")
    assert running_operator.is_alive()
    assert get_json(devcluster, "deployment", "vllm-embedded", "-n", ns) is None

    # Two more resyncs of the invalid object: neither retries nor repeated Events.
    wait_for_passes(running_operator, "Timer 'resync_llmservice'", ns, "vllm-embedded")
    warnings = [e for e in events(devcluster, ns, "vllm-embedded") if e["reason"] == "InvalidSpec"]
    assert len(warnings) == 1 and warnings[0].get("count", 1) == 1, warnings
    assert running_operator.log_tail(200_000).count("invalid spec; see the Ready condition") <= 1

    # Fixing the spec recovers without restarting anything.
    apply(devcluster, ns, llmservice("vllm-embedded", engine={"kind": "plimsoll"}))
    ready(devcluster, ns, "vllm-embedded")


def test_spec_change_rolls_and_children_are_restored(devcluster: Any, llms_namespace: str) -> None:
    ns, name = llms_namespace, "roll"
    apply(devcluster, ns, llmservice(name))
    ready(devcluster, ns, name)
    before = get_json(devcluster, "deployment", name, "-n", ns)

    apply(devcluster, ns, llmservice(name, engine={"maxNumSeqs": 16}))

    def rolled() -> dict[str, Any] | None:
        d = get_json(devcluster, "deployment", name, "-n", ns)
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        return (
            d
            if "--max-num-seqs" in args and d["metadata"]["generation"] > before["metadata"]["generation"]
            else None
        )

    wait_for(rolled, 60, "the Deployment to carry --max-num-seqs")
    svc = ready(devcluster, ns, name)
    assert condition(svc, "Ready")["observedGeneration"] == svc["metadata"]["generation"] == 2
    sets = get_json(devcluster, "replicasets", "-n", ns, "-l", f"plimsoll.dev/llmservice={name}")["items"]
    assert len(sets) == 2, "a new ReplicaSet for the new template"

    # Deleted by hand: back at once (child watch).
    old_uid = get_json(devcluster, "deployment", name, "-n", ns)["metadata"]["uid"]
    devcluster.kubectl("delete", "deployment", name, "-n", ns)
    wait_for(
        lambda: (d := get_json(devcluster, "deployment", name, "-n", ns)) and d["metadata"]["uid"] != old_uid,
        60,
        "the deleted Deployment to come back",
    )
    devcluster.kubectl("delete", "service,pdb", name, "-n", ns)
    wait_for(lambda: get_json(devcluster, "service", name, "-n", ns), 60, "the deleted Service to come back")
    wait_for(lambda: get_json(devcluster, "pdb", name, "-n", ns), 60, "the deleted PDB to come back")

    # Edited by hand: server-side apply takes the field back on the next resync.
    devcluster.kubectl("patch", "service", name, "-n", ns, "--type=json", "-p",
                       '[{"op": "replace", "path": "/spec/ports/0/port", "value": 9999}]')  # fmt: skip
    wait_for(
        lambda: get_json(devcluster, "service", name, "-n", ns)["spec"]["ports"][0]["port"] == 8000,
        60,
        "the edited Service port to be restored",
    )
    ready(devcluster, ns, name)


def test_deleting_the_llmservice_removes_every_child(devcluster: Any, llms_namespace: str) -> None:
    ns, name = llms_namespace, "gone"
    apply(devcluster, ns, llmservice(name))
    ready(devcluster, ns, name)
    devcluster.kubectl("delete", "llms", name, "-n", ns, "--wait=true", "--timeout=60s")

    def children_gone() -> bool:
        left = devcluster.kubectl(
            "get",
            "deployment,service,pdb,replicaset",
            "-n",
            ns,
            "-l",
            f"plimsoll.dev/llmservice={name}",
            "-o",
            "name",
        )
        return left.stdout.strip() == ""

    wait_for(children_gone, 90, "garbage collection of the children")


def test_scale_subresource(devcluster: Any, llms_namespace: str) -> None:
    ns, name = llms_namespace, "scaled"
    apply(devcluster, ns, llmservice(name, resources={"gpu": {"count": 1}}))
    ready(devcluster, ns, name)
    devcluster.kubectl("scale", "llms", name, "-n", ns, "--replicas=3")
    assert get_json(devcluster, "llms", name, "-n", ns)["spec"]["replicas"] == 3

    def three_ready() -> dict[str, Any] | None:
        obj = get_json(devcluster, "llms", name, "-n", ns)
        c = condition(obj, "Ready")
        return obj if obj["status"].get("readyReplicas") == 3 and c and c["status"] == "True" else None

    wait_for(three_ready, 120, "3 ready replicas")
    assert get_json(devcluster, "deployment", name, "-n", ns)["spec"]["replicas"] == 3

    def scale_of_three() -> dict[str, Any] | None:
        # /scale reads .status.replicas, which follows the Deployment's status a reconcile later
        # than readyReplicas may have been read above (a CI run saw 3 ready and replicas 1 once).
        scale: dict[str, Any] = json.loads(
            devcluster.kubectl(
                "get", "--raw", f"/apis/plimsoll.dev/v1alpha1/namespaces/{ns}/llmservices/{name}/scale"
            ).stdout
        )
        return scale if scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3 else None

    scale = wait_for(scale_of_three, 60, "/scale to report 3 replicas")
    assert f"plimsoll.dev/llmservice={name}" in scale["status"]["selector"]
    pods = get_json(devcluster, "pods", "-n", ns, "-l", scale["status"]["selector"])["items"]
    assert {p["spec"]["nodeName"] for p in pods} <= GPU_NODES and len(pods) == 3


def test_restart_mid_reconcile_converges(
    devcluster: Any, llms_namespace: str, running_operator: OperatorProcess
) -> None:
    ns = llms_namespace
    for i in range(5):
        apply(devcluster, ns, llmservice(f"r{i}"))
    # Kill (not stop) the operator while it works through them, then start it again.
    wait_for(lambda: get_json(devcluster, "deployment", "r0", "-n", ns), 60, "reconcile to start")
    running_operator.stop(kill=True)
    apply(devcluster, ns, llmservice("r0", engine={"maxNumSeqs": 4}))  # a change while it is down
    running_operator.start()
    for i in range(5):
        # Ready alone could be the status written before the kill (r0 was Ready at
        # generation 1): converged means Ready for the generation now stored.
        def converged(name: str = f"r{i}") -> dict[str, Any] | None:
            obj = get_json(devcluster, "llms", name, "-n", ns)
            c = condition(obj, "Ready")
            if not (obj and c and c["status"] == "True"):
                return None
            return obj if obj["status"].get("observedGeneration") == obj["metadata"]["generation"] else None

        wait_for(converged, 120, f"LLMService {ns}/r{i} Ready at its current generation")
    args = get_json(devcluster, "deployment", "r0", "-n", ns)["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert args[args.index("--max-num-seqs") + 1] == "4"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fifty_llmservices_become_ready(
    devcluster: Any, llms_namespace: str, running_operator: OperatorProcess
) -> None:
    """All 50 applied in one `kubectl apply`; reports p50/p95 apply→Ready and the operator's CPU and memory.

    benchmarks/operator_scale.py measures the same on a fresh cluster with more detail.
    """
    ns, count = llms_namespace, 50
    manifests = [llmservice(f"fleet-{i:02d}") for i in range(count)]
    cpu_before = running_operator.cpu_seconds()
    start = time.monotonic()
    devcluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(manifests))
    applied = time.monotonic() - start
    ready_at: dict[str, float] = {}
    peak_rss = 0
    deadline = start + 420
    while len(ready_at) < count and time.monotonic() < deadline:
        items = get_json(devcluster, "llms", "-n", ns)["items"]
        now = time.monotonic() - start
        for obj in items:
            c = condition(obj, "Ready")
            if c and c["status"] == "True":
                ready_at.setdefault(obj["metadata"]["name"], now)
        peak_rss = max(peak_rss, running_operator.rss_bytes())
        time.sleep(0.5)
    cpu = running_operator.cpu_seconds() - cpu_before
    assert len(ready_at) == count, (
        f"only {len(ready_at)}/{count} Ready; missing {sorted(set(m['metadata']['name'] for m in manifests) - set(ready_at))[:5]}"
    )
    times = sorted(ready_at.values())
    p50, p95 = times[len(times) // 2], times[int(0.95 * (len(times) - 1))]
    print(
        f"\n{count} LLMServices: kubectl apply {applied:.1f}s; apply->Ready p50 {p50:.1f}s p95 {p95:.1f}s max {times[-1]:.1f}s; "
        f"operator CPU {cpu:.1f}s ({cpu / times[-1]:.2f} cores avg), peak RSS {peak_rss / 2**20:.0f} MiB"
    )
    assert running_operator.is_alive()


@pytest.mark.parametrize("example", ["llmservice-embedded.yaml", "llmservice-qwen-vllm.yaml"])
def test_examples_and_their_children_pass_server_side_validation(
    devcluster: Any, operator_release: str, llms_namespace: str, example: str
) -> None:
    """The API server (schema, CEL, and its own Deployment/Service/PDB validation) accepts every example
    and every object the builders make from it."""
    from plimsoll.operator.api.llmservice import LLMService
    from plimsoll.operator.resources.deployment import build_deployment
    from plimsoll.operator.resources.disruption import build_pdb
    from plimsoll.operator.resources.service import build_service
    from plimsoll.operator.resources.settings import BuildSettings

    body = yaml.safe_load((EXAMPLE.parent / example).read_text())
    body["metadata"]["namespace"] = llms_namespace
    devcluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(body))
    svc = LLMService.from_body(body)
    children = [build_deployment(svc, BuildSettings()), build_service(svc), build_pdb(svc)]
    devcluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(children))


POD_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "kind": "PodMonitor",
            "plural": "podmonitors",
            "singular": "podmonitor",
            "listKind": "PodMonitorList",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}


def test_pod_monitor_only_once_its_crd_exists(devcluster: Any, llms_namespace: str) -> None:
    """Runs last in this module: it installs the Prometheus Operator's PodMonitor CRD (a minimal copy)."""
    ns, name = llms_namespace, "monitored"
    apply(devcluster, ns, llmservice(name))
    ready(devcluster, ns, name)
    assert devcluster.kubectl("get", "crd", "podmonitors.monitoring.coreos.com", check=False).returncode != 0
    devcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(POD_MONITOR_CRD))
    try:
        devcluster.kubectl(
            "wait", "--for=condition=Established", "crd/podmonitors.monitoring.coreos.com", "--timeout=60s"
        )
        monitor = wait_for(lambda: get_json(devcluster, "podmonitors", name, "-n", ns), 60, "the PodMonitor")
        assert monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
        assert monitor["metadata"]["ownerReferences"][0]["name"] == name
    finally:
        devcluster.kubectl("delete", "crd", "podmonitors.monitoring.coreos.com", "--wait=false", check=False)
