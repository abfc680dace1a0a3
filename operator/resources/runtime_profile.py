"""Profiling a replica on the ``plimsoll.dev/profile`` annotation: the request, the pod, the result's home. Pure.

What it is: the decisions of the annotation flow that need no cluster.
:func:`profile_request` reads ``plimsoll.dev/profile`` (a duration: ``20s``,
``2m``, ``45``) and ``plimsoll.dev/profile-kind`` (``torch`` by default, or
``py-spy``) and says what is wrong with them in words a user can act on;
:func:`ready_replica` picks the Ready serving pod to profile; :func:`stored_profile`
decides where the result lives — a ConfigMap (``binaryData``, gzip) when the
compressed profile fits well under the API server's 1 MiB object limit, else the
file the replica itself wrote on its volume — and the kubectl command that
fetches it from there.
What it is not: the I/O (``handlers/runtime_profile.py``) or the endpoint
(``runtime/serving/profiling.py``); nothing here measures capacity (that is the
benchmark Job of ``profile_job.py``).
"""

import base64
import re
import shlex
from dataclasses import dataclass
from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.labels import common_labels

PROFILE_ANNOTATION = "plimsoll.dev/profile"
PROFILE_KIND_ANNOTATION = "plimsoll.dev/profile-kind"
KINDS = ("torch", "py-spy")
MIN_SECONDS, MAX_SECONDS = 1, 300
# An object is at most 1 MiB in etcd; keep room for metadata and base64 (4/3) inside that.
CONFIGMAP_LIMIT_BYTES = 700 * 1024
FILE_SUFFIX = {"torch": ".json", "py-spy": ".svg"}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m)?\s*$")


class ProfileRequestError(ValueError):
    """The annotation cannot be acted on; the message says what to write instead."""


@dataclass(frozen=True)
class ProfileRequest:
    seconds: float
    kind: str


def profile_request(svc: LLMService) -> ProfileRequest:
    """What the annotations ask for; ProfileRequestError saying how to fix them."""
    annotations = svc.metadata.annotations
    raw = annotations.get(PROFILE_ANNOTATION, "")
    match = _DURATION.match(raw)
    if match is None:
        raise ProfileRequestError(
            f"annotation {PROFILE_ANNOTATION}={raw!r} is not a duration; write e.g. 20s, 2m or 45"
        )
    seconds = float(match.group(1)) * (60 if match.group(2) == "m" else 1)
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:
        raise ProfileRequestError(
            f"annotation {PROFILE_ANNOTATION}={raw!r}: profile between {MIN_SECONDS} s and {MAX_SECONDS} s"
        )
    kind = annotations.get(PROFILE_KIND_ANNOTATION, "torch")
    if kind not in KINDS:
        raise ProfileRequestError(f"annotation {PROFILE_KIND_ANNOTATION}={kind!r}: use torch or py-spy")
    if svc.spec.engine.kind != "plimsoll":
        raise ProfileRequestError(
            f"{PROFILE_ANNOTATION} profiles plimsoll replicas (POST /debug/profile); engine.kind is "
            f"{svc.spec.engine.kind} (vLLM profiles with VLLM_TORCH_PROFILER_DIR and /start_profile)"
        )
    if not svc.spec.engine.profiling:
        raise ProfileRequestError(
            "the replicas run without --enable-profiling; set spec.engine.profiling: true (this rolls the "
            f"replicas), then annotate again: kubectl annotate llms {svc.name} {PROFILE_ANNOTATION}={raw} --overwrite"
        )
    return ProfileRequest(seconds=seconds, kind=kind)


def ready_replica(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first (by name) Ready, not deleting serving pod with an IP."""
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            return pod
    return None


def configmap_name(svc: LLMService) -> str:
    return f"{svc.name}-runtime-profile"


def profile_key(kind: str, stamp: str) -> str:
    """ConfigMap key of one profile, e.g. ``profile-20260102T030405-torch.json.gz``."""
    return f"profile-{stamp}-{kind}{FILE_SUFFIX[kind]}.gz"


def fits_configmap(compressed: bytes) -> bool:
    return len(compressed) <= CONFIGMAP_LIMIT_BYTES


def build_profile_configmap(svc: LLMService, key: str, compressed: bytes, pod: str) -> dict[str, Any]:
    """The ConfigMap holding the latest profile (one key, gzip, in binaryData)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(svc),
            "namespace": svc.namespace,
            "labels": common_labels(svc, "runtime-profile"),
            "annotations": {"plimsoll.dev/profiled-pod": pod},
        },
        "binaryData": {key: base64.b64encode(compressed).decode()},
    }


def configmap_fetch_command(svc: LLMService, key: str) -> str:
    out = key.removesuffix(".gz")
    return (
        f"kubectl get configmap {configmap_name(svc)} -n {svc.namespace} "
        f"-o go-template='{{{{index .binaryData \"{key}\"}}}}' | base64 -d | gunzip > {out}"
    )


def pod_fetch_command(svc: LLMService, pod: str, path: str) -> str:
    """The kubectl command that copies the replica's file; the path comes from the replica, so every
    word is shell-quoted (a path like ``x; rm -rf ~`` stays one argument when the user pastes it)."""
    name = path.rsplit("/", 1)[-1] or "profile"
    return shlex.join(["kubectl", "cp", f"{svc.namespace}/{pod}:{path}", f"./{name}", "-c", "engine"])
