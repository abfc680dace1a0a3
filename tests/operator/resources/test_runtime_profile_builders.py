"""The plimsoll.dev/profile annotation's pure parts: the request, the pod, where the result lives."""

import base64
import gzip
import shlex
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


def test_a_replica_supplied_path_stays_one_quoted_word(tmp_path: Any) -> None:
    """The path comes from the replica's header: pasted into a shell it must not run anything."""
    svc = _svc({})
    marker = tmp_path / "pwned"
    command = pod_fetch_command(svc, "chat-abc", f"/tmp/x; touch {marker}; echo $(id)`id`.gz")
    words = shlex.split(command)
    assert words[:2] == ["kubectl", "cp"] and words[2] == f"ml/chat-abc:/tmp/x; touch {marker}; echo $(id)`id`.gz"
    subprocess.run(command.replace("kubectl", "true", 1), shell=True, check=True)
    assert not marker.exists()
