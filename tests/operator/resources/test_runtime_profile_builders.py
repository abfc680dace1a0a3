"""The plimsoll.dev/profile annotation's pure parts: the request, the pod, where the result lives."""

import base64
import gzip
import subprocess
from typing import Any

import pytest

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.runtime_profile import (
    CONFIGMAP_LIMIT_BYTES,
    ProfileRequestError,
    build_profile_configmap,
    configmap_fetch_command,
    fits_configmap,
    pod_fetch_command,
    profile_key,
    profile_request,
    ready_replica,
    replica_api_key,
)


def _svc(annotations: dict[str, str], **engine: Any) -> LLMService:
    return LLMService.model_validate(
        {
            "apiVersion": "plimsoll.dev/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": "chat", "namespace": "ml", "annotations": annotations},
            "spec": {"model": {"uri": "hf://org/m"}, "engine": {"profiling": True, **engine}},
        }
    )


@pytest.mark.parametrize(("value", "seconds"), [("20s", 20), ("2m", 120), ("45", 45), (" 1.5s ", 1.5)])
def test_durations_in_the_annotation(value: str, seconds: float) -> None:
    request = profile_request(_svc({"plimsoll.dev/profile": value}))
    assert (request.seconds, request.kind) == (seconds, "torch")


def test_the_kind_annotation_picks_py_spy() -> None:
    assert profile_request(_svc({"plimsoll.dev/profile": "5s", "plimsoll.dev/profile-kind": "py-spy"})).kind == "py-spy"


@pytest.mark.parametrize(
    ("annotations", "engine", "needle"),
    [({"plimsoll.dev/profile": "soon"}, {}, "write e.g. 20s"),
     ({"plimsoll.dev/profile": "10m"}, {}, "between 1 s and 300 s"),
     ({"plimsoll.dev/profile": "5s", "plimsoll.dev/profile-kind": "perf"}, {}, "use torch or py-spy"),
     ({"plimsoll.dev/profile": "5s"}, {"profiling": False}, "set spec.engine.profiling: true"),
     ({"plimsoll.dev/profile": "5s"}, {"kind": "vllm"}, "engine.kind is vllm")],
)  # fmt: skip
def test_requests_that_cannot_be_served_say_what_to_do(
    annotations: dict[str, str], engine: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ProfileRequestError, match=needle):
        profile_request(_svc(annotations, **engine))


def _pod(name: str, ready: bool, ip: str | None = "127.1.0.5", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, **({"deletionTimestamp": "now"} if deleting else {})}
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}], "podIP": ip}
    return {"metadata": meta, "status": status}


def test_the_profiled_pod_is_a_ready_one_with_an_ip() -> None:
    pods = [_pod("a", ready=False), _pod("b", ready=True, deleting=True), _pod("c", True, ip=None), _pod("d", True)]
    assert ready_replica(pods)["metadata"]["name"] == "d"  # type: ignore[index]
    assert ready_replica(pods[:3]) is None


def test_the_api_key_is_read_from_args_or_a_literal_env() -> None:
    assert replica_api_key(_svc({}, args=["--api-key", "k1"])) == ("k1", None)
    assert replica_api_key(_svc({}, args=["--api-key=k2"])) == ("k2", None)
    assert replica_api_key(_svc({}, env=[{"name": "PLIMSOLL_API_KEY", "value": "k3"}])) == ("k3", None)
    key, why = replica_api_key(_svc({}, env=[{"name": "PLIMSOLL_API_KEY", "valueFrom": {"secretKeyRef": {}}}]))
    assert key is None and why is not None and "plimsoll profile" in why
    assert replica_api_key(_svc({})) == (None, None)


def test_a_small_profile_goes_into_a_configmap_that_the_fetch_command_reads(tmp_path: Any) -> None:
    svc = _svc({})
    data = b'{"traceEvents": []}'
    compressed = gzip.compress(data)
    assert fits_configmap(compressed) and not fits_configmap(b"x" * (CONFIGMAP_LIMIT_BYTES + 1))
    key = profile_key("torch", "20260102T030405")
    assert key == "profile-20260102T030405-torch.json.gz"
    cm = build_profile_configmap(svc, key, compressed, "chat-abc")
    assert base64.b64decode(cm["binaryData"][key]) == compressed
    command = configmap_fetch_command(svc, key)
    assert command.startswith("kubectl get configmap chat-runtime-profile -n ml")
    # The pipeline after kubectl, fed what kubectl's go-template prints, gives the file back.
    pipeline = command.split("|", 1)[1].replace("> profile-", f"> {tmp_path}/profile-")
    subprocess.run(pipeline, shell=True, input=cm["binaryData"][key].encode(), check=True)
    assert (tmp_path / key.removesuffix(".gz")).read_bytes() == data
    assert pod_fetch_command(svc, "chat-abc", "/tmp/plimsoll-profiles/p.json.gz") == (
        "kubectl cp ml/chat-abc:/tmp/plimsoll-profiles/p.json.gz ./p.json.gz -c engine"
    )
