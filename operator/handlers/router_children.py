"""The router's children of an LLMService: which to apply, and removing them when it is turned off.

``spec.router.enabled`` adds a ServiceAccount, Role, RoleBinding, Deployment,
PodDisruptionBudget and Service (built in ``resources/router.py``) to what reconcile applies; turning it
off deletes exactly those objects again (only those this LLMService owns), with an Event saying so. What it is
not: the applying itself (reconcile's ``_apply_child`` does it for every child)
or the router's own replica discovery (``plimsoll route`` does that).
"""

from typing import Any, cast

import kopf

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.handler_types import BodyLike, Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.ownership import delete_owned, owned_by
from plimsoll.operator.resources.router import (
    build_router_deployment,
    build_router_pdb,
    build_router_rbac,
    build_router_service,
    router_name,
)
from plimsoll.operator.resources.settings import BuildSettings


def router_objects(svc: LLMService, settings: BuildSettings) -> list[dict[str, Any]]:
    """Every router object, RBAC first so the pod's ServiceAccount exists before the pod."""
    return [*build_router_rbac(svc), build_router_deployment(svc, settings), build_router_pdb(svc),
            build_router_service(svc)]  # fmt: skip


def router_children(svc: LLMService, settings: BuildSettings) -> list[dict[str, Any]]:
    """The router objects reconcile should apply: all of them when enabled, none otherwise."""
    return router_objects(svc, settings) if svc.spec.router_in_front() else []


async def remove_disabled_router(
    kube: Kube,
    body: BodyLike,
    svc: LLMService,
    settings: BuildSettings,
    logger: Log,
) -> tuple[str, ...]:
    """With the router off, delete what turning it on created; return what was deleted.

    The router Deployment is the marker: without it nothing is looked up further,
    so an LLMService that never had a router costs one GET per reconcile.
    """
    if svc.spec.router_in_front():
        return ()
    router = await kube.get("apps/v1", "Deployment", svc.namespace, router_name(svc))
    if router is None or not owned_by(router, body):
        return ()  # an `<name>-router` someone else made is theirs to keep
    removed: list[str] = []
    # Service first so clients stop being sent to a router that is going away.
    for obj in reversed(router_objects(svc, settings)):
        meta = obj["metadata"]
        if await delete_owned(kube, body, obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]):
            removed.append(f"{obj['kind']}/{meta['name']}")
    if removed:
        logger.info("router disabled: deleted %s", ", ".join(removed))
        kopf.info(
            cast(kopf.Body, body), reason="Deleted", message="router disabled: deleted " + ", ".join(removed)
        )
    return tuple(removed)


async def current_router(kube: Kube, svc: LLMService) -> dict[str, Any] | None:
    """The router's Deployment as stored, for Ready; None (and no lookup) when the router is off."""
    if not svc.spec.router_in_front():
        return None
    router: dict[str, Any] | None = await kube.get("apps/v1", "Deployment", svc.namespace, router_name(svc))
    return router
