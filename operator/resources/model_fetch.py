"""The download step of an hf:// model: cache volume, init container, and what its status means. Pure.

What it is: for ``model.uri: hf://org/name[@revision]`` the replica pod gets a cache
volume (the PVC ``model.cache.claimName``, the node-local directory ``model.cache.hostPath``,
else an emptyDir of ``model.cache.sizeLimit``)
and an init container running ``plimsoll fetch`` (``python -m plimsoll.model_fetch``,
``common/model_fetch.py``), which
downloads the snapshot with huggingface_hub before either engine starts; the engine then
loads the local directory with the hub switched off (``HF_HUB_OFFLINE=1``). The token,
when ``model.tokenSecretRef`` names one, reaches only the init container. It also reads
a pod's init-container status back into one condition (``fetch_condition``): the fetch
command's exit codes and termination message name the failure, so the operator can say
"repository not found" rather than "CrashLoopBackOff".

What it is not: the downloader (that runs in the pod) or the code that writes status.
A failed fetch is retried by the kubelet's own back-off (10 s doubling to 5 min), so a
wrong repository never hot-loops; this module only names what happened.
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.model_uri import ModelLocation
from plimsoll.operator.api.status import ConditionVerdict
from plimsoll.operator.resources.settings import BuildSettings

MODEL_CACHE_VOLUME = "model-cache"
MODEL_CACHE_MOUNT = "/var/cache/plimsoll/models"
# On a node-local cache (model.cache.hostPath) the engine's compilation cache lives beside the
# models in this subdirectory, created by the fetch as the image's user.
NODE_COMPILE_SUBDIR = "compile"
FETCH_CONTAINER = "fetch-model"

# Exit codes of `plimsoll fetch` (common/model_fetch.py) -> condition reason.
# Kept in step with FETCH_EXIT_CODES there; a test checks both tables agree.
FETCH_REASONS = {
    3: "RepositoryNotFound",
    4: "AccessDenied",
    5: "RevisionNotFound",
    6: "DiskFull",
    7: "DownloadFailed",
}


def hf_local_dir(location: ModelLocation) -> str:
    """Directory on the cache volume that holds one repository at one revision."""
    # refs/pr/1 -> refs--pr--1: one path segment per revision, as the hub's own cache does for repos.
    return f"{MODEL_CACHE_MOUNT}/hf/{location.name}/{location.revision.replace('/', '--')}"


def cache_volume(svc: LLMService) -> dict[str, Any]:
    """The pod volume weights are downloaded to: the named PVC, the node's directory, else a sized emptyDir."""
    cache = svc.spec.model.cache
    if cache.host_path is not None:
        # DirectoryOrCreate: the first pod on a fresh node makes it; the fetch fills it.
        return {
            "name": MODEL_CACHE_VOLUME,
            "hostPath": {"path": cache.host_path.path, "type": "DirectoryOrCreate"},
        }
    if cache.claim_name is not None:
        return {"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}}
    empty_dir: dict[str, Any] = {}
    if cache.size_limit is not None:
        empty_dir["sizeLimit"] = cache.size_limit
    return {"name": MODEL_CACHE_VOLUME, "emptyDir": empty_dir}


def build_fetch_container(
    svc: LLMService, location: ModelLocation, settings: BuildSettings, *, compile_dir: bool = False
) -> dict[str, Any]:
    """The init container that downloads ``location`` into the cache volume.

    It runs the plimsoll image for both engines (the vLLM image has no `plimsoll
    fetch`) and gets the engine's env too, so HF_ENDPOINT or proxy settings the user
    gives the engine apply to the download.
    """
    env: list[dict[str, Any]] = [
        # huggingface_hub keeps its own small state (locks, telemetry flags) under HF_HOME.
        {"name": "HF_HOME", "value": "/tmp/huggingface"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        *(e.to_api() for e in svc.spec.engine.env),
    ]
    token = svc.spec.model.token_secret_ref
    if token is not None:
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}}
        )
    uri = f"hf://{location.name}@{location.revision}"
    return {
        "name": FETCH_CONTAINER,
        "image": settings.plimsoll_image,
        # `plimsoll fetch` without loading the whole CLI: on a warm node cache start-up is the step's cost.
        "command": ["python", "-m", "plimsoll.model_fetch"],
        "args": [
            uri,
            "--local-dir",
            hf_local_dir(location),
            *(["--make-dir", f"{MODEL_CACHE_MOUNT}/{NODE_COMPILE_SUBDIR}"] if compile_dir else []),
        ],
        "env": env,
        # The fetch command writes its one-line reason there; logs stand in when it cannot.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
        },
        "volumeMounts": [
            {"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


# What the replicas' downloads say: ``status`` True (every pod has its weights),
# False (a download failed; ``reason`` names how) or Unknown (still downloading).
FetchCondition = ConditionVerdict


def _fetch_status(pod: dict[str, Any]) -> dict[str, Any] | None:
    statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
    return next((s for s in statuses if s.get("name") == FETCH_CONTAINER), None)


def _failure(pod_name: str, status: dict[str, Any]) -> FetchCondition | None:
    state = status.get("state") or {}
    terminated = state.get("terminated") or (status.get("lastState") or {}).get("terminated")
    if not terminated or terminated.get("exitCode", 0) == 0:
        return None
    code = int(terminated.get("exitCode", 1))
    reason = FETCH_REASONS.get(code, "DownloadFailed")
    detail = (terminated.get("message") or "").strip().splitlines()
    restarts = int(status.get("restartCount", 0) or 0)
    waiting = (state.get("waiting") or {}).get("reason")
    retry = f"; retried {restarts} times, kubelet back-off ({waiting})" if waiting else ""
    text = detail[-1] if detail else f"plimsoll fetch exited {code}"
    return FetchCondition("False", reason, f"pod {pod_name}: {text}{retry}"[:1000])


def fetch_condition(pods: list[dict[str, Any]]) -> FetchCondition | None:
    """One condition from the replica pods' fetch init containers (None when none has one).

    A failure anywhere wins (it is what the user must fix); else Unknown while any pod
    is still downloading; else True.
    """
    seen = [(p, s) for p in pods if (s := _fetch_status(p)) is not None]
    if not seen:
        return None
    for pod, status in seen:
        if status.get("ready"):
            continue  # done; an earlier failed attempt was overcome
        failure = _failure(pod["metadata"]["name"], status)
        if failure is not None:
            return failure
    pending = [p["metadata"]["name"] for p, s in seen if not s.get("ready")]
    if pending:
        return FetchCondition(
            "Unknown", "Downloading", f"downloading weights in {', '.join(sorted(pending))}"
        )
    return FetchCondition("True", "Downloaded", f"weights in place in {len(seen)} pod(s)")
