"""Pure rules of the pod runner: which pods run locally, the local command line, pod status."""

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from plimsoll.devcluster import podspec
from plimsoll.devcluster.podspec import ContainerState, Probe
from plimsoll.devcluster.stages import RUN_LOCALLY_ANNOTATION, RUN_LOCALLY_JQ, kwok_config


def _pod(
    image: str = "busybox", command: list[str] | None = None, annotation: str | None = None
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": image}
    if command is not None:
        container["command"] = command
    meta: dict[str, Any] = {"name": "p", "namespace": "ns"}
    if annotation is not None:
        meta["annotations"] = {RUN_LOCALLY_ANNOTATION: annotation}
    return {"metadata": meta, "spec": {"containers": [container]}}


@pytest.mark.parametrize(
    ("pod", "expected"),
    [
        (_pod("ghcr.io/acme/plimsoll:0.1"), True),
        (_pod("python:3.11", command=["plimsoll", "serve"]), True),
        (_pod("python:3.11", command=["python", "-m", "http.server"]), False),
        (_pod("python:3.11", command=["python"], annotation="true"), True),
        (_pod("plimsoll:dev", annotation="false"), False),
        (_pod("registry.k8s.io/pause:3.10"), False),
    ],
)
def test_which_pods_run_locally(pod: dict[str, Any], expected: bool) -> None:
    assert podspec.runs_locally(pod) is expected


def test_argv_binds_to_the_pod_ip_expands_vars_and_maps_model_volumes(tmp_path: Path) -> None:
    container = {
        "name": "server",
        "image": "plimsoll:dev",
        "command": ["plimsoll", "serve"],
        "args": [
            "--host",
            "0.0.0.0",
            "--port",
            "$(PORT)",
            "--model",
            "/models/smollm2",
            "--metrics=0.0.0.0:9000",
            "$$(PORT)",
        ],
        "volumeMounts": [
            {"name": "model-cache", "mountPath": "/models"},
            {"name": "tmp", "mountPath": "/tmp/x"},
        ],
    }
    pod = {"spec": {"volumes": [{"name": "model-cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]}}
    mounts = podspec.local_mounts(pod, container, tmp_path / "models", tmp_path / "scratch")
    assert mounts == {"/models": tmp_path / "models", "/tmp/x": tmp_path / "scratch" / "tmp"}
    argv = podspec.container_argv(container, {"PORT": "8000"}, "127.1.0.7", mounts)
    assert argv == [
        str(Path(sys.executable).with_name("plimsoll")),
        "serve", "--host", "127.1.0.7", "--port", "8000", "--model", f"{tmp_path}/models/smollm2",
        "--metrics=127.1.0.7:9000", "$(PORT)",
    ]  # fmt: skip
    env = podspec.map_env_paths({"MODEL": "/models/a", "OTHER": "/modelsx"}, mounts)
    assert env == {"MODEL": f"{tmp_path}/models/a", "OTHER": "/modelsx"}


def test_a_container_without_command_on_a_foreign_image_is_refused() -> None:
    with pytest.raises(ValueError, match="set `command`"):
        podspec.container_argv({"name": "c", "image": "nginx"}, {}, "127.1.0.2", {})
    assert podspec.container_argv(
        {"name": "c", "image": "plimsoll:dev", "args": ["operator"]}, {}, "127.1.0.2", {}
    )[1:] == ["operator"]


def test_probe_resolves_named_ports() -> None:
    container = {"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}
    probe = Probe.from_spec({"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1}, container)
    assert (probe.kind, probe.port, probe.path, probe.period) == ("http", 8000, "/ready", 1.0)
    assert Probe.from_spec(None, container).kind == "none"
    with pytest.raises(ValueError, match="names no port"):
        Probe.from_spec({"tcpSocket": {"port": "grpc"}}, container)


def test_pod_status_follows_container_states() -> None:
    c = ContainerState("main", "img", state="running", started_at="t0")
    status = podspec.pod_status([c], "Always", [], "t1")
    conds = {x["type"]: x for x in status["conditions"]}
    assert status["phase"] == "Running"
    assert conds["Ready"]["status"] == "False"
    c.ready = True
    status2 = podspec.pod_status([c], "Always", status["conditions"], "t2")
    conds2 = {x["type"]: x for x in status2["conditions"]}
    assert conds2["Ready"] == {"type": "Ready", "status": "True", "lastTransitionTime": "t2"}
    assert conds2["Initialized"]["lastTransitionTime"] == "t1", "unchanged conditions keep their time"

    c.state, c.ready, c.exit_code, c.reason = "terminated", False, 3, "Error"
    failed = podspec.pod_status([c], "Never", status2["conditions"], "t3")
    assert failed["phase"] == "Failed"
    assert failed["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    c.exit_code = 0
    assert podspec.pod_status([c], "OnFailure", [], "t3")["phase"] == "Succeeded"


def test_kwok_config_keeps_local_pods_out_of_the_simulated_lifecycle(tmp_path: Path) -> None:
    stock = tmp_path / "stages.yaml"
    stage = {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": "pod-ready"},
             "spec": {"resourceRef": {"apiGroup": "v1", "kind": "Pod"}, "selector": {"matchExpressions": []}, "next": {}}}  # fmt: skip
    node_stage = {
        **stage,
        "metadata": {"name": "node-init"},
        "spec": {**stage["spec"], "resourceRef": {"apiGroup": "v1", "kind": "Node"}},
    }
    stock.write_text(yaml.safe_dump_all([node_stage, stage]))

    plain = list(yaml.safe_load_all(kwok_config(stock, pod_runner=False)))
    assert [d["kind"] for d in plain] == ["KwokConfiguration", "Stage", "Stage"]
    # kwok 0.8.0 makes a CIDR's IP pool with a racy load-then-store: two pod workers
    # handed out 127.1.0.1 to two pods of one Deployment. One worker cannot race itself.
    assert plain[0]["options"]["podPlayStageParallelism"] == 1
    assert plain[2]["spec"]["selector"]["matchExpressions"] == []

    docs = {
        d["metadata"]["name"]: d
        for d in yaml.safe_load_all(kwok_config(stock, pod_runner=True))
        if d["kind"] == "Stage"
    }
    assert {"key": RUN_LOCALLY_JQ, "operator": "NotIn", "values": ["true"]} in docs["pod-ready"]["spec"][
        "selector"
    ]["matchExpressions"]
    assert docs["node-init"]["spec"]["selector"]["matchExpressions"] == []
    assert "plimsoll-local-pod-assign-ip" in docs


def test_an_upstream_image_runs_with_the_entrypoint_the_runner_was_given() -> None:
    vllm = {"name": "engine", "image": "vllm/vllm-openai:v0.32.0", "args": ["--model", "/m", "--host", "0.0.0.0"]}
    with pytest.raises(ValueError, match="--image-entrypoint"):
        podspec.container_argv(vllm, {}, "127.1.0.2", {})
    entry = {"vllm": ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]}
    assert podspec.container_argv(vllm, {}, "127.1.0.2", {}, entry) == [
        "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--host", "127.1.0.2",
    ]  # fmt: skip
    # A container with its own command keeps it: the entrypoint stands in only for the image's.
    sglang = {"name": "engine", "image": "lmsysorg/sglang:x", "command": ["python3", "-m", "sglang.launch_server"]}
    assert podspec.container_argv(sglang, {}, "127.1.0.2", {}, entry)[0] == sys.executable
