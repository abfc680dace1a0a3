"""Pure builders against golden files (tests/operator/resources/golden/).

Regenerate after an intended change with ``PLIMSOLL_UPDATE_GOLDEN=1`` and review
the diff like any code change.
"""

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.disruption import build_pdb
from plimsoll.operator.resources.engine import model_placement
from plimsoll.operator.resources.labels import selector_string
from plimsoll.operator.resources.monitoring import build_pod_monitor, build_service_monitor
from plimsoll.operator.resources.quantity import to_bytes
from plimsoll.operator.resources.service import build_service, endpoint_url
from plimsoll.operator.resources.settings import BuildSettings

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = Path(__file__).parent / "golden"
SETTINGS = BuildSettings(
    plimsoll_image="plimsoll:test",
    plimsoll_cuda_image="plimsoll:test-cuda",
    vllm_image="vllm/vllm-openai:v0.32.0",
    sglang_image="lmsysorg/sglang:test",
)


def _load(path: Path) -> LLMService:
    return LLMService.from_body(yaml.safe_load(path.read_text()))


CASES = {
    "embedded": ROOT / "examples" / "llmservice-embedded.yaml",
    "qwen-vllm": ROOT / "examples" / "llmservice-qwen-vllm.yaml",
    "hf-gateway": ROOT / "examples" / "llmservice-hf-gateway.yaml",
    "lora-vllm": ROOT / "examples" / "llmservice-lora.yaml",
    "qwen-sglang": ROOT / "examples" / "llmservice-qwen-sglang.yaml",
}


def _check_golden(name: str, objects: list[dict[str, Any]]) -> None:
    text = yaml.safe_dump_all(objects, sort_keys=True, width=120)
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("PLIMSOLL_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"{path} missing; run with PLIMSOLL_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{name}: builders changed output; review, then PLIMSOLL_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("name", sorted(CASES))
def test_children_match_golden(name: str) -> None:
    svc = _load(CASES[name])
    _check_golden(
        name,
        [
            build_deployment(svc, SETTINGS),
            build_service(svc),
            build_pdb(svc),
            build_pod_monitor(svc),
            build_service_monitor(svc),
        ],
    )


def test_plimsoll_engine_flags_and_embedded_model() -> None:
    svc = _load(CASES["embedded"])
    deployment = build_deployment(svc, SETTINGS)
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["plimsoll"]
    assert container["args"][:5] == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert "--model" not in container["args"], "embedded:// uses the image's converted copy"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1, "memory": "64Gi"}  # bounded by default
    assert container["resources"]["requests"] == {"memory": "1Gi"}  # not 64Gi to schedule
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] > container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels(deployment).items()


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def test_vllm_engine_maps_every_flag() -> None:
    svc = _load(CASES["qwen-vllm"])
    container = build_deployment(svc, SETTINGS)["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert "command" not in container, "the upstream image's entrypoint runs the server"
    assert args[args.index("--model") + 1] == "/mnt/models/qwen2.5-7b-instruct"
    assert args[args.index("--max-num-seqs") + 1] == "128"
    assert args[args.index("--max-num-batched-tokens") + 1] == "8192"
    assert args[args.index("--max-model-len") + 1] == "16384"
    assert args[args.index("--served-model-name") + 1] == "Qwen/Qwen2.5-7B-Instruct"
    assert "--enable-prefix-caching" in args
    assert args[-2:] == ["--gpu-memory-utilization", "0.90"], "user args come last so they win"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["resources"]["limits"] == {"cpu": "8", "memory": "48Gi", "nvidia.com/gpu": 1}


def test_spec_change_changes_pod_template() -> None:
    body = yaml.safe_load(CASES["embedded"].read_text())
    before = build_deployment(LLMService.from_body(body), SETTINGS)["spec"]["template"]
    body["spec"]["engine"] = {
        "maxNumSeqs": 8,
        "prefixCaching": False,
        "kvCacheMemory": "1Gi",
        "blockSize": 32,
    }
    after = build_deployment(LLMService.from_body(body), SETTINGS)["spec"]["template"]
    assert before != after
    args = after["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "8"
    assert args[args.index("--kv-cache-memory") + 1] == str(2**30)
    assert args[args.index("--block-size") + 1] == "32"
    assert "--no-enable-prefix-caching" in args


@pytest.mark.parametrize(
    ("uri", "model_arg", "volume_keys"),
    [
        ("pvc://weights", "/mnt/models", ["persistentVolumeClaim"]),
        ("hf://Qwen/Qwen2.5-0.5B", "/var/cache/plimsoll/models/hf/Qwen/Qwen2.5-0.5B/main", ["emptyDir"]),
        (
            "hf://Qwen/Qwen2.5-0.5B@refs/pr/1",
            "/var/cache/plimsoll/models/hf/Qwen/Qwen2.5-0.5B/refs--pr--1",
            ["emptyDir"],
        ),
        ("file:///opt/models/x", "/opt/models/x", []),
        ("embedded://smollm2-135m", None, []),
    ],
)
def test_model_placement(uri: str, model_arg: str | None, volume_keys: list[str]) -> None:
    svc = LLMService.from_body({"metadata": {"name": "m"}, "spec": {"model": {"uri": uri}}})
    placement = model_placement(svc)
    assert placement.model_arg == model_arg
    assert [k for v in placement.volumes for k in v if k != "name"] == volume_keys


def test_cpu_only_replica_requests_no_gpu() -> None:
    svc = LLMService.from_body(
        {
            "metadata": {"name": "cpu"},
            "spec": {"model": {"uri": "embedded://smollm2-135m"}, "resources": {"gpu": {"count": 0}}},
        }
    )
    pod = build_deployment(svc, SETTINGS)["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in str(pod["containers"][0].get("resources"))
    assert "tolerations" not in pod


def test_service_pdb_and_selector_agree() -> None:
    svc = _load(CASES["embedded"])
    service, pdb = build_service(svc), build_pdb(svc)
    labels = pod_labels(build_deployment(svc, SETTINGS))
    assert service["spec"]["selector"].items() <= labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert dict(kv.split("=") for kv in selector_string(svc).split(",")) == service["spec"]["selector"]
    assert endpoint_url(svc) == "http://smollm2.default.svc:8000/v1"


@pytest.mark.parametrize(
    ("quantity", "expected"), [("8Gi", 8 * 2**30), ("500M", 500 * 10**6), (1024, 1024), ("1.5Ki", 1536)]
)
def test_quantity_to_bytes(quantity: int | str, expected: int) -> None:
    assert to_bytes(quantity) == expected


def test_quantity_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not a memory quantity"):
        to_bytes("eight gigs")


def engine_of(body: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = build_deployment(LLMService.from_body(body), SETTINGS)["spec"]["template"][
        "spec"
    ]["containers"][0]
    return container


def test_gpu_replicas_get_the_cuda_image_device_and_memory_share_cpu_replicas_neither() -> None:
    body = yaml.safe_load(CASES["embedded"].read_text())
    gpu = engine_of(body)
    assert gpu["image"] == "plimsoll:test-cuda"
    assert gpu["args"][gpu["args"].index("--device") + 1] == "cuda"
    assert gpu["args"][gpu["args"].index("--gpu-memory-utilization") + 1] == "0.9"  # the CRD's default
    body["spec"]["engine"] = {"gpuMemoryUtilization": 0.75}
    assert "0.75" in engine_of(body)["args"]  # the CRD field reaches the pod's args
    body["spec"]["engine"] = {"args": ["--device", "cuda:1", "--gpu-memory-utilization=0.5"]}
    args = engine_of(body)["args"]
    assert args.count("--device") == 1 and "--gpu-memory-utilization" not in args  # the user's win
    body["spec"]["engine"] = {"args": ["--device", "cpu"]}  # a simulated GPU node: served from the CPU
    args = engine_of(body)["args"]
    assert args.count("--device") == 1 and "--gpu-memory-utilization" not in args
    body["spec"]["resources"] = {"gpu": {"count": 0}, "cpu": "4", "memory": "8Gi"}
    body["spec"]["engine"] = {}
    cpu = engine_of(body)
    assert cpu["image"] == "plimsoll:test"
    assert "--device" not in cpu["args"] and "--gpu-memory-utilization" not in cpu["args"]


def test_the_crd_carries_gpu_memory_utilization_with_vllms_default() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "llmservices.plimsoll.dev.yaml").read_text())
    engine = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "engine"
    ]
    field = engine["properties"]["gpuMemoryUtilization"]
    assert field["default"] == 0.9 and field["maximum"] == 1.0
    assert field["minimum"] == 0.0 and field["exclusiveMinimum"] is True
    with pytest.raises(ValueError):
        LLMService.from_body(
            {
                **yaml.safe_load(CASES["embedded"].read_text()),
                "spec": {"engine": {"gpuMemoryUtilization": 1.5}},
            }
        )


def test_plimsoll_replicas_keep_compile_caches_on_a_pod_volume() -> None:
    """--compilation-cache-dir on an emptyDir: a restarted container maps the packed panels it wrote."""
    body = yaml.safe_load(CASES["embedded"].read_text())
    body["spec"]["resources"] = {"gpu": {"count": 0}}  # a CPU replica
    pod = build_deployment(LLMService.from_body(body), SETTINGS)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    mount_path = args[args.index("--compilation-cache-dir") + 1]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == mount_path]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"] == {
        "sizeLimit": SETTINGS.compile_cache_size_limit
    }  # outlives restarts, bounded
    assert not mount.get("readOnly")

    # A directory of the user's own (their PVC) wins: no second flag, no operator volume.
    body["spec"]["volumes"] = [{"name": "compile", "persistentVolumeClaim": {"claimName": "cc"}}]
    body["spec"]["volumeMounts"] = [{"name": "compile", "mountPath": "/cache"}]
    for user_args in (
        ["--compilation-cache-dir", "/cache"],
        ["--compilation-config", '{"cache_dir": "/cache"}'],
    ):
        body["spec"]["engine"] = {"args": user_args}
        pod = build_deployment(LLMService.from_body(body), SETTINGS)["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert args.count("--compilation-cache-dir") == user_args.count("--compilation-cache-dir")
        assert mount["name"] not in {v["name"] for v in pod["volumes"]}

    # Other engines bring their own caches.
    vllm = build_deployment(_load(CASES["qwen-vllm"]), SETTINGS)["spec"]["template"]["spec"]
    assert "--compilation-cache-dir" not in vllm["containers"][0]["args"]
    assert mount["name"] not in {v["name"] for v in vllm["volumes"]}
