"""The pod runner: pods that really run as local processes bound to their pod IP,
Ready only when their readiness probe answers, restarted when they exit, stopped when deleted,
and Job pods that report their exit codes."""

import ipaddress
import json
import os
import signal
from typing import Any

import httpx
import pytest
import yaml

from plimsoll.devcluster.cluster import Cluster, wait_until
from plimsoll.devcluster.stages import RUN_LOCALLY_ANNOTATION

pytestmark = pytest.mark.k8s

# A server that only starts answering after a delay, bound to whatever argv[1] says.
SLOW_SERVER = (
    "import http.server, sys, time\n"
    "time.sleep(float(sys.argv[3]))\n"
    "http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), http.server.SimpleHTTPRequestHandler)"
    ".serve_forever()\n"
)


def _server_deployment(name: str, delay_s: float) -> dict[str, Any]:
    container = {
        "name": "web",
        "image": "python:3.11-slim",
        # A wildcard bind, as in a real manifest; the runner rewrites it to the pod IP.
        "command": ["python", "-c", SLOW_SERVER, "0.0.0.0", "8080", str(delay_s)],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        # Liveness alone would kill the slow starter after 2 s; the startup probe holds it off.
        "startupProbe": {
            "httpGet": {"path": "/", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 60,
        },
        "livenessProbe": {
            "httpGet": {"path": "/", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": 1}}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}, "annotations": {RUN_LOCALLY_ANNOTATION: "true"}},
                "spec": {"containers": [container], "terminationGracePeriodSeconds": 5},
            },
        },
    }


def _pods(cluster: Cluster, ns: str, selector: str) -> list[dict[str, Any]]:
    return list(cluster.get_json("pods", "-n", ns, "-l", selector)["items"])


def _is_ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", [])
    )


def _answers(ip: str, port: int = 8080) -> bool:
    try:
        return httpx.get(f"http://{ip}:{port}/", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_pod_is_ready_only_when_its_process_answers_on_the_pod_ip(
    devcluster: Cluster, namespace: str
) -> None:
    devcluster.apply(
        yaml.safe_dump(
            {**_server_deployment("web", delay_s=6.0), "metadata": {"name": "web", "namespace": namespace}}
        )
    )

    def running() -> dict[str, Any] | None:
        pods = _pods(devcluster, namespace, "app=web")
        statuses = pods[0].get("status", {}).get("containerStatuses", []) if pods else []
        return pods[0] if statuses and "running" in statuses[0]["state"] else None

    pod = wait_until(running, 60, "the web container to be started by the pod runner")
    ip = pod["status"]["podIP"]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(devcluster.pod_cidr)
    assert ipaddress.ip_address(ip).is_loopback
    # The process sleeps before listening: the pod must not be Ready yet (kwok would say Ready at once).
    assert not _is_ready(pod)
    assert not _answers(ip)

    devcluster.kubectl(
        "wait", "--for=condition=Ready", f"pod/{pod['metadata']['name']}", "-n", namespace, "--timeout=60s"
    )
    assert _answers(ip), "Ready pod must answer at http://<podIP>:8080"
    status = devcluster.get_json("pod", pod["metadata"]["name"], "-n", namespace)["status"]
    assert status["containerStatuses"][0]["restartCount"] == 0, "liveness must wait for the startup probe"
    events = devcluster.get_json(
        "events", "-n", namespace, "--field-selector", f"involvedObject.name={pod['metadata']['name']}"
    )
    assert any(e["reason"] == "Started" for e in events["items"])


def test_exited_container_is_restarted_and_deleted_pod_is_stopped(
    devcluster: Cluster, namespace: str
) -> None:
    devcluster.apply(
        yaml.safe_dump(
            {
                **_server_deployment("crash", delay_s=0.0),
                "metadata": {"name": "crash", "namespace": namespace},
            }
        )
    )
    devcluster.kubectl("rollout", "status", "deployment/crash", "-n", namespace, "--timeout=60s")
    pod = _pods(devcluster, namespace, "app=crash")[0]
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
    assert _answers(ip)

    # Kill the container's process as if it crashed: the runner restarts it, as a kubelet would.
    record = json.loads((devcluster.state_dir / "pods" / f"{namespace}_{name}_web.proc.json").read_text())
    os.kill(record["pid"], signal.SIGKILL)

    def restarted_and_ready() -> bool:
        p = devcluster.get_json("pod", name, "-n", namespace)
        cs = p["status"]["containerStatuses"][0]
        return bool(cs["restartCount"] >= 1 and _is_ready(p))

    wait_until(restarted_and_ready, 60, "the killed container to be restarted and Ready again")
    cs = devcluster.get_json("pod", name, "-n", namespace)["status"]["containerStatuses"][0]
    assert cs["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL
    assert _answers(ip)

    devcluster.kubectl("delete", "deployment", "crash", "-n", namespace, "--wait=false")
    wait_until(lambda: not _pods(devcluster, namespace, "app=crash"), 60, "the pod to be deleted")
    assert not _answers(ip), "the process must stop when its pod goes"


@pytest.mark.parametrize(("exit_code", "phase"), [(0, "Succeeded"), (3, "Failed")])
def test_job_pod_reports_its_exit_code(
    devcluster: Cluster, namespace: str, exit_code: int, phase: str
) -> None:
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "once", "namespace": namespace},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": {RUN_LOCALLY_ANNOTATION: "true"}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "main",
                            "image": "python:3.11-slim",
                            "command": [
                                "python",
                                "-c",
                                f"import sys, time; time.sleep(1); sys.exit({exit_code})",
                            ],
                        }
                    ],
                },
            },
        },
    }
    devcluster.apply(yaml.safe_dump(job))

    def finished() -> dict[str, Any] | None:
        pods = _pods(devcluster, namespace, "job-name=once")
        return pods[0] if pods and pods[0]["status"].get("phase") in ("Succeeded", "Failed") else None

    pod = wait_until(finished, 60, "the Job's pod to finish")
    assert pod["status"]["phase"] == phase
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == exit_code
    condition = "Complete" if exit_code == 0 else "Failed"
    devcluster.kubectl("wait", f"--for=condition={condition}", "job/once", "-n", namespace, "--timeout=60s")


@pytest.mark.slow
def test_plimsoll_serve_pod_serves_the_openai_api_on_its_pod_ip(
    devcluster: Cluster, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The real runtime as a pod: model volume mapped to a local dir, --host 0.0.0.0 bound to the pod IP."""
    import openai

    from plimsoll.runtime.testing import write_tiny_model

    models = tmp_path_factory.mktemp("models")
    write_tiny_model(models / "tiny")
    container = {
        "name": "server",
        "image": "plimsoll:dev",
        "command": ["plimsoll", "serve"],
        "args": [
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--model",
            "/models/tiny",
            "--served-model-name",
            "tiny",
            "--kv-cache-memory",
            "16MiB",
            "--max-model-len",
            "128",
        ],
        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": 8000}, "periodSeconds": 1},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "llm", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "llm"}},
            "template": {
                "metadata": {"labels": {"app": "llm"}},
                "spec": {
                    "containers": [container],
                    "volumes": [{"name": "models", "hostPath": {"path": str(models)}}],
                },
            },
        },
    }
    devcluster.apply(yaml.safe_dump(deployment))
    devcluster.kubectl("rollout", "status", "deployment/llm", "-n", namespace, "--timeout=300s", timeout=320)
    ip = _pods(devcluster, namespace, "app=llm")[0]["status"]["podIP"]
    client = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", timeout=60)
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert out.usage is not None and out.usage.completion_tokens >= 1
    metrics = httpx.get(f"http://{ip}:8000/metrics", timeout=5).text
    assert "plimsoll_" in metrics
