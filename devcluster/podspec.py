"""Pure translation of a pod's spec into local processes, and of their state into pod status.

Which pods run locally (:func:`runs_locally`), the command line a container runs
here (:func:`container_argv`), and the status a kubelet would report
(:func:`pod_status`). No I/O: the pod runner (``podrunner.py``) does that.

How a container is mapped onto this machine (the differences from a kubelet):

* ``command`` + ``args`` run directly, with ``$(VAR)`` expanded from the
  container's env as a kubelet does. ``plimsoll`` becomes this installation's
  ``plimsoll`` script and ``python``/``python3`` this interpreter; an empty
  ``command`` on a plimsoll image means the image's entrypoint, ``plimsoll``, and on
  another image the entrypoint the runner was given for it (``--image-entrypoint
  vllm='/venv/bin/python -m vllm.entrypoints.openai.api_server'``: an upstream engine
  installed in its own venv stands in for its image).
* Wildcard binds become the pod IP: an argument ``0.0.0.0`` or ``::``, or one
  ending in ``=0.0.0.0`` or holding ``0.0.0.0:<port>``, is rewritten to the pod's
  loopback IP, so ``plimsoll serve --host 0.0.0.0 --port 8000`` listens on
  ``<podIP>:8000`` and many pods can use the same port.
* Volume mounts map to local directories: ``hostPath`` to its path, a volume whose
  name contains ``model`` (or any PVC) to the local model cache
  (``$PLIMSOLL_CACHE_DIR``, default ``~/.cache/plimsoll/models``), anything else
  (emptyDir, configMap …) to a per-pod scratch directory. Arguments and env values
  that start with a mount path are rewritten to the local directory.
* There is no image, no filesystem isolation, no resource limits, and exec
  probes are not run (a container with one counts as ready once started).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plimsoll.devcluster.stages import RUN_LOCALLY_ANNOTATION

WILDCARDS = ("0.0.0.0", "::", "[::]")


def runs_locally(pod: Mapping[str, Any]) -> bool:
    """True for a pod the runner starts; the same rule as ``stages.RUN_LOCALLY_JQ``."""
    annotation = (pod.get("metadata", {}).get("annotations") or {}).get(RUN_LOCALLY_ANNOTATION, "")
    if annotation == "true":
        return True
    if annotation == "false":
        return False
    for c in pod.get("spec", {}).get("containers", []):
        if "plimsoll" in (c.get("image") or "") or (c.get("command") or [None])[0] == "plimsoll":
            return True
    return False


_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def expand_refs(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: known names are replaced, unknown kept, ``$$`` escapes."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR_REF.sub(sub, text)


def _bind_to_pod_ip(arg: str, pod_ip: str) -> str:
    if arg in WILDCARDS:
        return pod_ip
    for w in WILDCARDS:
        if arg.endswith("=" + w):
            return arg[: -len(w)] + pod_ip
        if arg.startswith(w + ":") or f"={w}:" in arg:
            return arg.replace(w + ":", pod_ip + ":", 1)
    return arg


def _map_paths(value: str, mounts: Mapping[str, Path]) -> str:
    # Longest mount path first, so /models/cache wins over /models.
    for mount in sorted(mounts, key=len, reverse=True):
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return str(mounts[mount]) + value[len(mount.rstrip("/")) :]
        if "=" in value:
            key, _, rest = value.partition("=")
            if rest == mount or rest.startswith(mount.rstrip("/") + "/"):
                return f"{key}={mounts[mount]}{rest[len(mount.rstrip('/')) :]}"
    return value


def local_mounts(
    pod: Mapping[str, Any], container: Mapping[str, Any], model_cache: Path, scratch: Path
) -> dict[str, Path]:
    """Container mount path -> local directory (see the module docstring)."""
    volumes = {v["name"]: v for v in pod.get("spec", {}).get("volumes", []) or []}
    mounts: dict[str, Path] = {}
    for m in container.get("volumeMounts", []) or []:
        vol = volumes.get(m["name"], {})
        if "hostPath" in vol:
            local = Path(vol["hostPath"]["path"])
        elif "model" in m["name"].lower() or "persistentVolumeClaim" in vol:
            local = model_cache
        else:
            local = scratch / m["name"]
        if m.get("subPath"):
            local = local / m["subPath"]
        mounts[m["mountPath"]] = local
    return mounts


def _executable(name: str) -> str:
    if name == "plimsoll":
        return str(Path(sys.executable).with_name("plimsoll"))
    if name in ("python", "python3"):
        return sys.executable
    return name


def container_argv(
    container: Mapping[str, Any],
    env: Mapping[str, str],
    pod_ip: str,
    mounts: Mapping[str, Path],
    entrypoints: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """The local command line for a container (see the module docstring for the rewrites).

    ``entrypoints`` maps a part of an image name (``vllm``) to the local command that
    stands in for that image's entrypoint.
    """
    command = list(container.get("command") or [])
    image = container.get("image") or ""
    if not command:
        local = next((list(cmd) for part, cmd in (entrypoints or {}).items() if part in image), None)
        if local is not None:
            command = local
        elif "plimsoll" in image:
            command = ["plimsoll"]
        else:
            raise ValueError(
                f"container {container.get('name')!r} has no command and its image {image!r} "
                "is not a plimsoll image, so its entrypoint is unknown here; set `command`, or start the "
                "pod runner with --image-entrypoint PART=COMMAND for that image"
            )
    argv = [expand_refs(a, env) for a in [*command, *(container.get("args") or [])]]
    argv = [_map_paths(_bind_to_pod_ip(a, pod_ip), mounts) for a in argv]
    argv[0] = _executable(argv[0])
    return argv


def map_env_paths(env: Mapping[str, str], mounts: Mapping[str, Path]) -> dict[str, str]:
    return {k: _map_paths(v, mounts) for k, v in env.items()}


def field_ref(pod: Mapping[str, Any], path: str) -> str:
    """Value of a downward-API ``fieldRef.fieldPath``."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        return str(simple[path] or "")
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    raise ValueError(f"fieldRef {path!r} is not supported by the pod runner")


@dataclass(frozen=True, slots=True)
class Probe:
    """An HTTP GET or TCP probe resolved to an address; ``kind`` is ``http``, ``tcp`` or ``none``."""

    kind: str
    port: int = 0
    path: str = "/"
    scheme: str = "HTTP"
    initial_delay: float = 0.0
    period: float = 10.0
    timeout: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None, container: Mapping[str, Any]) -> Probe:
        if not spec:
            return cls("none")

        def timed(kind: str, port: int = 0, path: str = "/", scheme: str = "HTTP") -> Probe:
            return cls(
                kind,
                port,
                path,
                scheme,
                initial_delay=float(spec.get("initialDelaySeconds", 0)),
                period=float(spec.get("periodSeconds", 10)),
                timeout=float(spec.get("timeoutSeconds", 1)),
                failure_threshold=int(spec.get("failureThreshold", 3)),
                success_threshold=int(spec.get("successThreshold", 1)),
            )

        if "httpGet" in spec:
            h = spec["httpGet"]
            return timed("http", _port(h["port"], container), h.get("path", "/"), h.get("scheme", "HTTP"))
        if "tcpSocket" in spec:
            return timed("tcp", _port(spec["tcpSocket"]["port"], container))
        return timed("none")  # exec and grpc probes are not run here


def _port(port: int | str, container: Mapping[str, Any]) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports", []) or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"probe port {port!r} names no port of container {container.get('name')!r}")


@dataclass(slots=True)
class ContainerState:
    """What the runner knows about one container, in kubelet terms."""

    name: str
    image: str
    state: str = "waiting"  # waiting | running | terminated
    reason: str = "ContainerCreating"
    ready: bool = False
    restart_count: int = 0
    exit_code: int | None = None
    started_at: str | None = None
    finished_at: str | None = None
    message: str = ""
    last_exit_code: int | None = None
    last_started_at: str | None = None
    last_finished_at: str | None = None
    last_message: str = ""

    def status(self) -> dict[str, Any]:
        state: dict[str, Any]
        if self.state == "running":
            state = {"running": {"startedAt": self.started_at}}
        elif self.state == "terminated":
            state = {
                "terminated": {
                    "exitCode": self.exit_code,
                    "reason": self.reason,
                    "startedAt": self.started_at,
                    "finishedAt": self.finished_at,
                    **({"message": self.message} if self.message else {}),
                }
            }
        else:
            state = {
                "waiting": {"reason": self.reason, **({"message": self.message} if self.message else {})}
            }
        out: dict[str, Any] = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": self.ready,
            "started": self.state == "running",
            "restartCount": self.restart_count,
            "state": state,
            "lastState": {},
        }
        if self.last_exit_code is not None:
            out["lastState"] = {
                "terminated": {
                    "exitCode": self.last_exit_code,
                    "reason": "Completed" if self.last_exit_code == 0 else "Error",
                    "startedAt": self.last_started_at,
                    "finishedAt": self.last_finished_at,
                    **({"message": self.last_message} if self.last_message else {}),
                }
            }
        return out


def pod_phase(containers: list[ContainerState], restart_policy: str) -> str:
    """Kubelet's phase rule for the states the runner produces."""
    if any(c.state == "running" for c in containers):
        return "Running"
    if containers and all(c.state == "terminated" for c in containers):
        if restart_policy == "Always":
            return "Running"  # about to be restarted
        return "Succeeded" if all(c.exit_code == 0 for c in containers) else "Failed"
    if any(c.restart_count > 0 for c in containers):
        return "Running"  # waiting in back-off after a restart
    return "Pending"


def pod_status(
    containers: list[ContainerState],
    restart_policy: str,
    previous_conditions: list[dict[str, Any]],
    now: str,
    init_containers: list[ContainerState] | None = None,
) -> dict[str, Any]:
    """The ``status`` a kubelet would write; keeps ``lastTransitionTime`` of unchanged conditions.

    Init containers run one after another before the others; until all have completed
    the pod is not Initialized (and, unless one failed for good, Pending)."""
    inits = init_containers or []
    initialized = all(c.state == "terminated" and c.exit_code == 0 for c in inits)
    phase = pod_phase(containers, restart_policy)
    if not initialized:
        failed = (
            any(c.state == "terminated" and c.exit_code != 0 for c in inits) and restart_policy == "Never"
        )
        # A kubelet keeps the pod Pending (Init:CrashLoopBackOff) while an init container retries.
        phase = "Failed" if failed else "Pending"
    all_ready = initialized and bool(containers) and all(c.ready for c in containers)
    wanted = {
        "PodReadyToStartContainers": True,
        "Initialized": initialized,
        "ContainersReady": all_ready,
        "Ready": all_ready,
        "PodScheduled": True,
    }
    if phase in ("Succeeded", "Failed"):
        wanted["PodReadyToStartContainers"] = False
    before = {c["type"]: c for c in previous_conditions}
    conditions = []
    for ctype, ok in wanted.items():
        status = "True" if ok else "False"
        prev = before.get(ctype)
        cond: dict[str, Any] = {"type": ctype, "status": status}
        cond["lastTransitionTime"] = (
            prev["lastTransitionTime"]
            if prev and prev.get("status") == status and prev.get("lastTransitionTime")
            else now
        )
        if not ok and ctype in ("Ready", "ContainersReady"):
            cond["reason"] = "PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady"
            not_ready = [c.name for c in containers if not c.ready]
            cond["message"] = f"containers with unready status: [{' '.join(not_ready)}]"
        conditions.append(cond)
    status = {"phase": phase, "conditions": conditions, "containerStatuses": [c.status() for c in containers]}
    if inits:
        status["initContainerStatuses"] = [c.status() for c in inits]
    return status
