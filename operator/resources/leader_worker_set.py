"""The replicas of a multi-node LLMService as a LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``). Pure.

What it is: :func:`build_leader_worker_set` for ``resources.nodes`` above 1. Each
replica is one LWS group of ``nodes`` pods: the leader (worker index 0) is the
serving pod the Deployment would have run (same labels, probes, volumes, so the
Service, the autoscaler's scrape and the profile Job find it as before) and the
workers carry another component label, so nothing routes to them. vLLM's
multi-node layout is used: tensor parallel across the GPUs of one node,
pipeline stages across the nodes (``engine.py`` adds ``--pipeline-parallel-size``),
the ranks joined by Ray: the leader starts the Ray head and waits until
``LWS_GROUP_SIZE`` nodes joined before it serves; each worker joins
``$LWS_LEADER_ADDRESS`` (both variables are set by the LWS controller).
``RecreateGroupOnPodRestart``: a group that lost a rank is restarted whole,
never left half-serving. Every node runs Ray with token authentication
(``RAY_AUTH_MODE=token``, the token from the LLMService's credentials Secret), and
the NetworkPolicy opens Ray's ports only between the LLMService's own pods.
What it is not: the choice between this and a Deployment (reconcile checks that
the LWS API is served), or any support for plimsoll's runtime across nodes (the
API refuses ``engine.kind plimsoll`` with more than one node).
"""

import copy
import shlex
from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.credentials import ray_auth_env
from plimsoll.operator.resources.deployment import replica_pod_template
from plimsoll.operator.resources.labels import common_labels
from plimsoll.operator.resources.settings import BuildSettings

LWS_GROUP_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_PLURAL = "leaderworkersets"
LWS_KIND = "LeaderWorkerSet"
WORKER_COMPONENT = "worker"
RAY_PORT = 6379
# How long the leader waits for the whole group before it exits (the group is then recreated).
GROUP_WAIT_SECONDS = 900

_COUNT_RAY_NODES = (
    "import ray; ray.init(address='auto', logging_level='ERROR'); "
    "print(sum(1 for n in ray.nodes() if n['Alive']))"
)


def uses_leader_worker_set(svc: LLMService) -> bool:
    return bool(svc.spec.resources.nodes > 1)


def _leader_script(container: dict[str, Any]) -> str:
    serve = shlex.join(["python3", "-m", "vllm.entrypoints.openai.api_server", *container["args"]])
    return (
        f"ray start --head --port={RAY_PORT} && "
        f'waited=0; until [ "$(python3 -c "{_COUNT_RAY_NODES}" 2>/dev/null)" = "$LWS_GROUP_SIZE" ]; do '
        f"if [ $waited -ge {GROUP_WAIT_SECONDS} ]; then "
        'echo "only part of the group joined Ray after ${waited}s" >&2; exit 1; fi; '
        "sleep 5; waited=$((waited+5)); done; "
        f"exec {serve}"
    )


def build_leader_worker_set(
    svc: LLMService, settings: BuildSettings, replicas: int | None = None
) -> dict[str, Any]:
    """The LeaderWorkerSet for ``svc``: ``replicas`` groups of ``resources.nodes`` pods."""
    leader = replica_pod_template(svc, settings)
    engine = leader["spec"]["containers"][0]
    engine["command"] = ["/bin/sh", "-c"]
    engine["args"] = [_leader_script(engine)]
    # Ray's token authentication: without it any pod that reaches the head can run code on the GPUs.
    engine["env"] = [*engine.get("env", []), *ray_auth_env(svc)]

    worker = copy.deepcopy(leader)
    worker["metadata"] = {"labels": common_labels(svc, WORKER_COMPONENT)}
    rank = worker["spec"]["containers"][0]
    rank["name"] = "worker"
    rank["args"] = [f"exec ray start --address=$LWS_LEADER_ADDRESS:{RAY_PORT} --block"]
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        rank.pop(key, None)
    spec = svc.spec
    return {
        "apiVersion": LWS_GROUP_VERSION,
        "kind": LWS_KIND,
        "metadata": {"name": svc.name, "namespace": svc.namespace, "labels": common_labels(svc)},
        "spec": {
            "replicas": spec.desired_replicas() if replicas is None else replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "leaderWorkerTemplate": {
                "size": spec.resources.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }
