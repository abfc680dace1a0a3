"""The DaemonSet that fills a node-local model cache ahead (``model.cache.prefill``). Pure.

What it is: with ``model.cache.hostPath`` and ``prefill: true`` each node the replicas may
run on (their node selector, affinity and tolerations; with ``spec.variants`` any variant's
nodes) runs one pod of ``<name>-model-cache``. Its init container is the replicas' own
``fetch-model`` (``model_fetch.py``: the same image, env, token and target directory), so
the node's directory holds the snapshot, verified by hash, before any replica starts
there; its one container then only holds the pod (a Ready pod = a filled node) and asks
for almost nothing. A replica starting on that node finds the files present and verified
and downloads nothing; the two never write at once (``plimsoll fetch`` locks the
directory). A new revision in ``model.uri`` changes the pod template, so the DaemonSet's
rolling update fills the new snapshot on every node.

What it is not: a cache manager. Nothing is evicted: old snapshots stay on the node until
someone removes them (their directories are named by repository and revision).
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.model_uri import parse_model_uri
from plimsoll.operator.resources.deployment import RUN_AS_USER
from plimsoll.operator.resources.engine import node_compile_cache
from plimsoll.operator.resources.labels import common_labels, selector_labels
from plimsoll.operator.resources.model_fetch import (
    FetchCondition,
    build_fetch_container,
    cache_volume,
    fetch_condition,
)
from plimsoll.operator.resources.settings import BuildSettings

COMPONENT = "model-cache"
HOLD_CONTAINER = "hold"


def model_cache_name(svc: LLMService) -> str:
    return f"{svc.name}-model-cache"


def wants_prefill(svc: LLMService) -> bool:
    cache = svc.spec.model.cache
    return (
        cache.prefill and cache.host_path is not None and parse_model_uri(svc.spec.model.uri).scheme == "hf"
    )


def _placement(svc: LLMService) -> dict[str, Any]:
    """Where the replicas may run, as pod-spec fields: the DaemonSet's pods go to those nodes only."""
    spec = svc.spec
    tolerations = list(spec.scheduling.tolerations)
    if spec.resources.gpu.count > 0:
        tolerations.append(
            {"key": spec.resources.gpu.resource_name, "operator": "Exists", "effect": "NoSchedule"}
        )
    placement: dict[str, Any] = {}
    if spec.variants:
        # A node of any variant: one node-selector term per variant (terms are ORed).
        terms = []
        for variant in spec.variants:
            labels = {**spec.scheduling.node_selector, **variant.node_selector}
            exprs = [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(labels.items())]
            terms.append({"matchExpressions": exprs})
            tolerations.extend(t for t in variant.tolerations if t not in tolerations)
        if all(t["matchExpressions"] for t in terms):
            placement["affinity"] = {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
                }
            }
    else:
        if spec.scheduling.node_selector:
            placement["nodeSelector"] = dict(spec.scheduling.node_selector)
        if spec.scheduling.affinity and "nodeAffinity" in spec.scheduling.affinity:
            # Only node affinity: pod (anti-)affinity is about replicas, not about where a cache belongs.
            placement["affinity"] = {"nodeAffinity": spec.scheduling.affinity["nodeAffinity"]}
    if tolerations:
        placement["tolerations"] = tolerations
    return placement


def build_model_cache_daemonset(svc: LLMService, settings: BuildSettings) -> dict[str, Any]:
    """The DaemonSet that downloads ``model.uri`` into ``model.cache.hostPath`` on the replicas' nodes."""
    location = parse_model_uri(svc.spec.model.uri)
    # The replicas' own fetch, the compile-cache directory included (its args must match theirs).
    fetch = build_fetch_container(svc, location, settings, compile_dir=node_compile_cache(svc))
    labels = common_labels(svc, COMPONENT)
    hold = {
        "name": HOLD_CONTAINER,
        "image": settings.plimsoll_image,
        # Sleeps until the pod is deleted (SIGTERM ends it at once): a Ready pod says the node is filled.
        "command": ["python", "-c", "import signal; signal.pause()"],
        "resources": {"requests": {"cpu": "1m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": fetch["securityContext"],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": model_cache_name(svc), "namespace": svc.namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": selector_labels(svc, COMPONENT)},
            # One node at a time re-fills on a new revision; the replicas keep the old snapshot meanwhile.
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": 5,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": RUN_AS_USER,
                        "runAsGroup": RUN_AS_USER,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "initContainers": [fetch],
                    "containers": [hold],
                    "volumes": [cache_volume(svc), {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}],
                    **(
                        {"imagePullSecrets": [s.to_api() for s in svc.spec.image_pull_secrets]}
                        if svc.spec.image_pull_secrets
                        else {}
                    ),
                    **(
                        {"priorityClassName": svc.spec.scheduling.priority_class_name}
                        if svc.spec.scheduling.priority_class_name
                        else {}
                    ),
                    **_placement(svc),
                },
            },
        },
    }


def cache_condition(daemonset: dict[str, Any] | None, pods: list[dict[str, Any]]) -> FetchCondition | None:
    """``ModelCached`` from the DaemonSet's status and its pods' fetch init containers (None: not read yet).

    True once every node it was scheduled on has a Ready, current pod; False when a node's
    download failed (the reason ``plimsoll fetch`` gave) or no node matches the replicas'
    placement; Unknown while nodes are still filling.
    """
    if daemonset is None:
        return None
    status = daemonset.get("status") or {}
    if (status.get("observedGeneration") or 0) < (daemonset.get("metadata", {}).get("generation") or 0):
        return FetchCondition("Unknown", "Filling", "the model-cache DaemonSet is being updated")
    desired = int(status.get("desiredNumberScheduled") or 0)
    if desired == 0:
        return FetchCondition(
            "False",
            "NoMatchingNodes",
            "no node matches the replicas' nodeSelector, affinity and tolerations, so no node cache is filled",
        )
    failed = fetch_condition(pods)
    if failed is not None and failed.status == "False":
        return failed
    ready = int(status.get("numberReady") or 0)
    current = int(status.get("updatedNumberScheduled") or 0)
    if ready >= desired and current >= desired:
        return FetchCondition("True", "Filled", f"the model is in place and verified on {desired} node(s)")
    return FetchCondition("Unknown", "Filling", f"{min(ready, current)} of {desired} node(s) hold the model")
