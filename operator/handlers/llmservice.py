"""kopf registrations for LLMService: one reconcile behind every trigger.

- create / update / resume: reconcile; an invalid spec becomes kopf.PermanentError
  (recorded as InvalidSpec once, never retried until the spec changes);
- a timer re-runs reconcile, which restores children edited or deleted by hand
  even if their watch event was missed;
- watches on the children: a deleted child triggers reconcile of its owner at
  once, a Deployment status change refreshes the owner's status (Ready follows
  the pods without polling).

Importing this module registers the handlers with kopf's default registry; the
CLI (``operator/cli.py``) imports it and runs kopf.
"""

import json
import logging
import os
from typing import Any

import kopf
from pydantic import ValidationError

from plimsoll.operator.api.base import API_VERSION, GROUP, KIND, PLURAL, VERSION
from plimsoll.operator.handlers.adapters import sync_adapters
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.reconcile import parse, reconcile, write_status
from plimsoll.operator.resources.labels import LLMSERVICE_LABEL, MANAGED_BY
from plimsoll.operator.resources.settings import BuildSettings

COMPONENT_LABEL = "app.kubernetes.io/component"

_CHILD_FILTER: dict[str, Any] = {
    "app.kubernetes.io/managed-by": MANAGED_BY,
    LLMSERVICE_LABEL: kopf.PRESENT,
}
RESYNC_SECONDS = float(os.environ.get("PLIMSOLL_RESYNC_SECONDS", "30"))
# Set by the CLI when --namespace is given: namespaced RBAC cannot watch CRDs
# cluster-wide, so kopf resolves its resources once at start instead.
CLUSTERWIDE = True


def settings_from_env() -> BuildSettings:
    """Images, drain timings and the NetworkPolicy's peers from the environment the Helm chart sets."""
    overrides: dict[str, Any] = {}
    for env, field in (
        ("PLIMSOLL_IMAGE", "plimsoll_image"),
        ("PLIMSOLL_VLLM_IMAGE", "vllm_image"),
        ("PLIMSOLL_SGLANG_IMAGE", "sglang_image"),
        ("PLIMSOLL_TERMINATION_GRACE_SECONDS", "termination_grace_period_seconds"),
        ("PLIMSOLL_PRESTOP_SLEEP_SECONDS", "pre_stop_sleep_seconds"),
        ("PLIMSOLL_OPERATOR_NAMESPACE", "operator_namespace"),
    ):
        if os.environ.get(env):
            overrides[field] = os.environ[env]
    for env, field in (
        ("PLIMSOLL_OPERATOR_POD_LABELS", "operator_pod_labels"),
        ("PLIMSOLL_METRICS_SCRAPER_PEERS", "metrics_scraper_peers"),
    ):
        if os.environ.get(env):
            overrides[field] = json.loads(os.environ[env])
    if "PLIMSOLL_ENGINE_MEMORY_LIMIT" in os.environ:
        overrides["engine_memory_limit"] = os.environ["PLIMSOLL_ENGINE_MEMORY_LIMIT"] or None
    return BuildSettings.model_validate(overrides)


@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Progress and diff-base in annotations under our own prefix: status stays
    # ours, and `kubectl get -o yaml` shows who wrote what.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.INFO
    settings.scanning.disabled = not CLUSTERWIDE
    settings.execution.max_workers = 20
    settings.networking.request_timeout = 30
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    memo.kube = await Kube.connect()
    memo.build = settings_from_env()


@kopf.on.cleanup()
async def _cleanup(memo: kopf.Memo, **_: Any) -> None:
    if getattr(memo, "kube", None) is not None:
        await memo.kube.close()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile_llmservice(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """The single reconcile path for create, update and resume."""
    try:
        await reconcile(memo.kube, body, memo.build, logger)
    except ValidationError as error:
        # The user's mistake: retrying cannot fix it, the next spec edit will.
        raise kopf.PermanentError("invalid spec; see the Ready condition") from error


@kopf.timer(
    GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, idle=RESYNC_SECONDS / 2
)
async def resync_llmservice(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Periodic safety net: the same reconcile, quiet for invalid specs (already reported)."""
    try:
        await reconcile(memo.kube, body, memo.build, logger)
    except ValidationError:
        return


async def _owner(memo: kopf.Memo, namespace: str, labels: dict[str, str]) -> dict[str, Any] | None:
    name = labels.get(LLMSERVICE_LABEL)
    if not name:
        return None
    owner: dict[str, Any] | None = await memo.kube.get(API_VERSION, KIND, namespace, name)
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return None  # being deleted: garbage collection removes the children
    return owner


def _removed_router(owner: dict[str, Any], meta: dict[str, Any]) -> bool:
    """A router child deleted while the owner's router is off: nothing to restore."""
    if (meta.get("labels") or {}).get(COMPONENT_LABEL) != "router":
        return False
    try:
        return not parse(owner).spec.router_in_front()
    except ValidationError:
        return False


async def _on_child(event: kopf.RawEvent, memo: kopf.Memo, logger: kopf.Logger) -> None:
    obj: dict[str, Any] = dict(event.get("object") or {})
    meta = obj.get("metadata", {})
    owner = await _owner(memo, meta.get("namespace", ""), meta.get("labels", {}) or {})
    if owner is None:
        return
    if event.get("type") == "DELETED":
        if _removed_router(owner, meta):
            return  # reconcile deleted it on purpose: router.enabled is false
        logger.info("%s %s was deleted; restoring it", obj.get("kind"), meta.get("name"))
        try:
            await reconcile(memo.kube, owner, memo.build, logger)
        except ValidationError:
            return
    elif obj.get("kind") == "Deployment":
        try:
            svc = parse(owner)
        except ValidationError:
            return
        component = (meta.get("labels") or {}).get(COMPONENT_LABEL)
        if component == "router":
            # The router's readiness is part of Ready, but replicas/readyReplicas are the replicas'.
            replicas = await memo.kube.get("apps/v1", "Deployment", svc.namespace, svc.name)
            await write_status(memo.kube, owner, svc, replicas)
        elif component == "replica":
            await write_status(memo.kube, owner, svc, obj)
            # A replica that just turned Ready gets its adapters now, not at the next resync.
            await sync_adapters(memo.kube, owner, svc, logger)


@kopf.on.event("apps", "v1", "deployments", labels=_CHILD_FILTER)
async def deployment_event(event: kopf.RawEvent, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Deployment status → owner status; Deployment deleted → owner reconciled."""
    await _on_child(event, memo, logger)


@kopf.on.event("v1", "services", labels=_CHILD_FILTER)
async def service_event(event: kopf.RawEvent, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Service deleted by hand → owner reconciled."""
    if event.get("type") == "DELETED":
        await _on_child(event, memo, logger)


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=_CHILD_FILTER)
async def pdb_event(event: kopf.RawEvent, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """PodDisruptionBudget deleted by hand → owner reconciled."""
    if event.get("type") == "DELETED":
        await _on_child(event, memo, logger)
