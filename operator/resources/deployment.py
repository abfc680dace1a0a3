"""The replicas' Deployment. Pure: LLMService in, Deployment dict out.

GPU requests through ``resources.gpu.resourceName``, the engine container from
``engine.py``, a non-root pod, a grace period long enough for streams to drain,
and the user's scheduling constraints passed through. Does not decide the replica
count beyond what the spec says (the autoscaler owns that) and does no I/O.
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.model_uri import parse_model_uri
from plimsoll.operator.resources.adapters import adapter_placement, fetch_container_name
from plimsoll.operator.resources.engine import (
    COMPILE_CACHE_VOLUME,
    HOME_CACHE_VOLUME,
    engine_container,
    node_compile_cache,
    operator_compile_cache,
)
from plimsoll.operator.resources.labels import common_labels, selector_labels
from plimsoll.operator.resources.model_fetch import build_fetch_container, cache_volume
from plimsoll.operator.resources.pool_view import ROLE_LABEL, Role, pool_view
from plimsoll.operator.resources.settings import ENGINE_PORT, BuildSettings

# Non-root identity shared by the plimsoll image (Dockerfile) and applied to vLLM's.
RUN_AS_USER = 1000


def replica_pod_template(
    svc: LLMService, settings: BuildSettings, role: Role = "decode", component: str = "replica"
) -> dict[str, Any]:
    """The pod template of a serving pod (a Deployment's replica, or a LeaderWorkerSet's leader).

    On a split service (``spec.disaggregation``) the pod is one of pool ``role``'s (``pool_view.py``)
    and carries its role label; ``component`` is the pool's selector component.
    """
    split = svc.spec.disaggregation is not None
    svc = pool_view(svc, role)
    spec = svc.spec
    container, placement = engine_container(svc, settings)
    adapters = adapter_placement(svc)
    tolerations = list(spec.scheduling.tolerations)
    if spec.resources.gpu.count > 0:
        # GPU nodes are commonly tainted with their resource name; a GPU pod belongs there.
        tolerations.append(
            {"key": spec.resources.gpu.resource_name, "operator": "Exists", "effect": "NoSchedule"}
        )

    pod_spec: dict[str, Any] = {
        # A ServiceAccount the user names is there to be used (workload identity); else no token.
        "automountServiceAccountToken": spec.service_account_name is not None,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": settings.termination_grace_period_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            *placement.volumes,
            *adapters.volumes,
            *([cache_volume(svc)] if adapters.needs_cache_volume else []),
            # vLLM and torch use shared memory between workers; the default 64 MiB is too small.
            # Both are bounded: a full /tmp evicts this pod, it cannot fill the node's disk or memory.
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size_limit}},
            {"name": "tmp", "emptyDir": {"sizeLimit": settings.tmp_size_limit}},
            *([{"name": HOME_CACHE_VOLUME, "emptyDir": {"sizeLimit": "1Gi"}}] if spec.engine.kind == "plimsoll" else []),
            *(
                [{"name": COMPILE_CACHE_VOLUME, "emptyDir": {"sizeLimit": settings.compile_cache_size_limit}}]
                if operator_compile_cache(svc) and not node_compile_cache(svc)
                else []
            ),
            *spec.volumes,
        ],
    }
    location = parse_model_uri(spec.model.uri)
    init = (
        [build_fetch_container(svc, location, settings, compile_dir=node_compile_cache(svc))]
        if location.scheme == "hf"
        else []
    )
    for name, adapter_location in adapters.hf_locations:
        # hf:// adapters are downloaded at pod start like the model; the engine loads them through its API.
        fetch = build_fetch_container(svc, adapter_location, settings)
        init.append({**fetch, "name": fetch_container_name(name)})
    if init:
        pod_spec["initContainers"] = init
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [s.to_api() for s in spec.image_pull_secrets]
    if spec.scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(spec.scheduling.node_selector)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.scheduling.affinity:
        pod_spec["affinity"] = spec.scheduling.affinity
    if spec.scheduling.priority_class_name:
        pod_spec["priorityClassName"] = spec.scheduling.priority_class_name
    labels = common_labels(svc, component)
    if split:
        labels[ROLE_LABEL] = role
    return {
        "metadata": {
            "labels": labels,
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(ENGINE_PORT),
                "prometheus.io/path": "/metrics",
                **spec.pod_annotations,
            },
        },
        "spec": pod_spec,
    }


def build_deployment(svc: LLMService, settings: BuildSettings, replicas: int | None = None) -> dict[str, Any]:
    """The Deployment for ``svc``; ``replicas`` overrides the spec's count (the autoscaler's decision).

    With ``autoscaling.standby`` it also runs the parked replicas (asleep beside the active ones; the
    planner parks and wakes them, ``operator/scaling/standby.py``).
    """
    spec = svc.spec
    parked = spec.autoscaling.standby.replicas if spec.autoscaling.standby is not None else 0
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": svc.name, "namespace": svc.namespace, "labels": common_labels(svc)},
        "spec": {
            "replicas": (spec.desired_replicas() if replicas is None else replicas) + parked,
            "selector": {"matchLabels": selector_labels(svc)},
            # Never drop below the current capacity during a rollout; the surge pod
            # needs free GPUs, which is the usual price of zero-downtime updates.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": replica_pod_template(svc, settings),
        },
    }
