"""Which workload carries the replicas: a Deployment, or a LeaderWorkerSet for multi-node replicas.

What it is: :func:`replica_workload`, the one place reconcile asks for the
replicas' object. ``resources.nodes: 1`` builds the Deployment; above 1 it builds
a LeaderWorkerSet when ``leaderworkersets.leaderworkerset.x-k8s.io`` is served
(API discovery, cached briefly), and otherwise returns the reason to report as
InvalidSpec (what to install), so reconcile records it once and creates nothing:
no crash loop, and the next pass after the LWS release is installed goes ahead.
The workload of the other kind, when the operator made one before the spec moved
between one node and several, is deleted (only with the operator's managed-by
label), so two sets of replicas never run side by side.
What it is not: the builders (``resources/deployment.py``,
``resources/leader_worker_set.py``).
"""

from dataclasses import dataclass
from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.handler_types import Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.ownership import delete_owned
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.leader_worker_set import (
    LWS_GROUP_VERSION,
    LWS_KIND,
    LWS_PLURAL,
    build_leader_worker_set,
    uses_leader_worker_set,
)
from plimsoll.operator.resources.settings import BuildSettings

LWS_RELEASE_HINT = (
    "install the LeaderWorkerSet controller and CRD (kubernetes-sigs/lws, e.g. "
    "`kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/download/v0.7.0/manifests.yaml`)"
)


@dataclass(frozen=True)
class Workload:
    """The replicas' object to apply, or why there is none."""

    obj: dict[str, Any] | None
    unservable: str | None = None
    removed: str | None = None  # "Deployment/NAME" when the other kind was deleted


async def _delete_ours(kube: Kube, api_version: str, kind: str, svc: LLMService) -> bool:
    return await delete_owned(kube, svc, api_version, kind, svc.namespace, svc.name)


async def replica_workload(kube: Kube, svc: LLMService, settings: BuildSettings, logger: Log) -> Workload:
    """The Deployment or LeaderWorkerSet for ``svc`` (see the module docstring)."""
    lws_served = await kube.has_resource(LWS_GROUP_VERSION, LWS_PLURAL)
    if uses_leader_worker_set(svc):
        if not lws_served:
            return Workload(
                obj=None,
                unservable=f"spec.resources.nodes: {svc.spec.resources.nodes} nodes per replica need a "
                f"LeaderWorkerSet, but {LWS_PLURAL}.leaderworkerset.x-k8s.io is not served by this cluster; "
                f"{LWS_RELEASE_HINT}",
            )
        removed = None
        if await _delete_ours(kube, "apps/v1", "Deployment", svc):
            logger.info(
                "deleted Deployment %s: replicas now span %d nodes", svc.name, svc.spec.resources.nodes
            )
            removed = f"Deployment/{svc.name}"
        return Workload(obj=build_leader_worker_set(svc, settings), removed=removed)
    removed = None
    if lws_served and await _delete_ours(kube, LWS_GROUP_VERSION, LWS_KIND, svc):
        logger.info("deleted LeaderWorkerSet %s: replicas now fit one node", svc.name)
        removed = f"LeaderWorkerSet/{svc.name}"
    return Workload(obj=build_deployment(svc, settings), removed=removed)
