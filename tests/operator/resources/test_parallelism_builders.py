"""GPUs per replica → --tensor-parallel-size, and multi-node replicas → a LeaderWorkerSet. Pure builders."""

from typing import Any

import pytest
from pydantic import ValidationError

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.leader_worker_set import build_leader_worker_set, uses_leader_worker_set
from plimsoll.operator.resources.service import build_service
from plimsoll.operator.resources.settings import BuildSettings

SETTINGS = BuildSettings(plimsoll_image="plimsoll:test", vllm_image="vllm/vllm-openai:v0.32.0")


def _svc(engine: dict[str, Any] | None = None, **resources: Any) -> LLMService:
    return LLMService.model_validate(
        {
            "apiVersion": "plimsoll.dev/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": "big", "namespace": "ml", "generation": 1},
            "spec": {"model": {"uri": "hf://org/big"}, "engine": engine or {}, "resources": resources},
        }
    )


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def _engine(obj: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = obj["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize("kind", ["plimsoll", "vllm"])
def test_gpus_per_pod_become_the_tensor_parallel_size_and_the_gpu_request(kind: str) -> None:
    engine = _engine(build_deployment(_svc({"kind": kind}, gpu={"count": 4}), SETTINGS))
    assert _flag(engine["args"], "--tensor-parallel-size") == "4"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_one_gpu_or_none_passes_no_tensor_parallel_flag() -> None:
    for count in (0, 1):
        assert (
            "--tensor-parallel-size"
            not in _engine(build_deployment(_svc(gpu={"count": count}), SETTINGS))["args"]
        )


def test_the_field_and_then_the_args_override_the_default() -> None:
    field = _engine(build_deployment(_svc({"tensorParallelSize": 2}, gpu={"count": 4}), SETTINGS))
    assert _flag(field["args"], "--tensor-parallel-size") == "2"
    assert field["resources"]["limits"]["nvidia.com/gpu"] == 4  # still the pod's GPUs
    args = _engine(build_deployment(_svc({"args": ["--tensor-parallel-size=1"]}, gpu={"count": 4}), SETTINGS))
    assert "--tensor-parallel-size" not in args["args"] and "--tensor-parallel-size=1" in args["args"]
    short = _engine(build_deployment(_svc({"args": ["-tp", "2"]}, gpu={"count": 4}), SETTINGS))
    assert short["args"].count("-tp") == 1 and "--tensor-parallel-size" not in short["args"]


def test_cpu_tensor_parallelism_is_allowed_for_plimsoll() -> None:
    engine = _engine(build_deployment(_svc({"tensorParallelSize": 2}, gpu={"count": 0}), SETTINGS))
    assert _flag(engine["args"], "--tensor-parallel-size") == "2"
    assert "nvidia.com/gpu" not in engine.get("resources", {}).get("limits", {})


@pytest.mark.parametrize(
    ("engine", "resources", "needle"),
    [({"tensorParallelSize": 8}, {"gpu": {"count": 4}}, "raise resources.gpu.count to 8"),
     ({"kind": "vllm"}, {"nodes": 2, "gpu": {"count": 0}}, "needs resources.gpu.count of at least 1"),
     ({}, {"nodes": 2, "gpu": {"count": 8}}, "use engine.kind vllm for replicas across nodes")],
)  # fmt: skip
def test_parallelism_the_pod_cannot_give_is_refused_with_how_to_fix_it(
    engine: dict[str, Any], resources: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ValidationError, match=needle):
        _svc(engine, **resources)


def test_profiling_flag_follows_the_spec() -> None:
    assert "--enable-profiling" not in _engine(build_deployment(_svc(), SETTINGS))["args"]
    assert "--enable-profiling" in _engine(build_deployment(_svc({"profiling": True}), SETTINGS))["args"]


def test_multi_node_vllm_replicas_are_leader_worker_set_groups() -> None:
    svc = _svc({"kind": "vllm"}, nodes=2, gpu={"count": 8})
    assert uses_leader_worker_set(svc)
    lws = build_leader_worker_set(svc, SETTINGS, replicas=3)
    assert (lws["apiVersion"], lws["kind"], lws["spec"]["replicas"]) == (
        "leaderworkerset.x-k8s.io/v1",
        "LeaderWorkerSet",
        3,
    )
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"

    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    serving = leader["spec"]["containers"][0]
    script = serving["args"][0]
    assert serving["command"] == ["/bin/sh", "-c"]
    assert "ray start --head" in script and '"$LWS_GROUP_SIZE"' in script
    assert "--tensor-parallel-size 8" in script and "--pipeline-parallel-size 2" in script
    assert "--distributed-executor-backend ray" in script and "--served-model-name big" in script
    assert "readinessProbe" in serving and serving["resources"]["limits"]["nvidia.com/gpu"] == 8

    rank = worker["spec"]["containers"][0]
    assert rank["args"] == ["exec ray start --address=$LWS_LEADER_ADDRESS:6379 --block"]
    assert rank["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert not {"readinessProbe", "ports"} & set(rank)
    # The Service selects the leaders only: workers carry another component label.
    selector = build_service(svc)["spec"]["selector"]
    assert selector.items() <= leader["metadata"]["labels"].items()
    assert not selector.items() <= worker["metadata"]["labels"].items()
    # Both pods get the model (the fetch init container) and tolerate the GPU taint.
    for pod in (leader, worker):
        assert [c["name"] for c in pod["spec"].get("initContainers", [])] == ["fetch-model"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"][
            "tolerations"
        ]
