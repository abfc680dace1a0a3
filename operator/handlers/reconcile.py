"""The one idempotent reconcile of an LLMService: validate, apply every child, write status.

Children are applied only when absent or owned by this LLMService (``ownership.py``): an
object of the same name that someone else made is left untouched and reported as
``OwnershipConflict``, and the other children are still applied.

Create, update, resume, the periodic timer and child-deletion events all call
:func:`reconcile`; running it twice in a row changes nothing the second time
(server-side apply of identical objects is a no-op). Every change it makes is
reported as an Event on the LLMService. It does not decide replica counts (the
spec and the autoscaler in ``operator/scaling`` do) and does not watch anything.
"""

from dataclasses import dataclass
from typing import Any, cast

import kopf
from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import ValidationError

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.adapters import sync_adapters
from plimsoll.operator.handlers.credentials import ensure_credentials
from plimsoll.operator.handlers.external_autoscaler import ensure_external_autoscaler
from plimsoll.operator.handlers.handler_types import BodyLike, Log
from plimsoll.operator.handlers.inference_pool import remove_unused_inference_pool
from plimsoll.operator.handlers.kube import Kube, contains
from plimsoll.operator.handlers.model_download import report_model_download
from plimsoll.operator.handlers.ownership import (
    OwnershipConflict,
    delete_owned,
    existing_owned,
    has_conflict,
    report_conflicts,
)
from plimsoll.operator.handlers.replica_planning import (
    kopf_events,
    size_new_service,
    start_variant_deployments,
)
from plimsoll.operator.handlers.replica_workload import replica_workload
from plimsoll.operator.handlers.router_children import current_router, remove_disabled_router, router_children
from plimsoll.operator.handlers.spans import llmservice_span
from plimsoll.operator.handlers.status_writer import MAX_MESSAGE, update_status
from plimsoll.operator.handlers.variant_workloads import remove_variant_workloads, variant_workloads
from plimsoll.operator.resources.credentials import admin_secret_name
from plimsoll.operator.resources.disruption import build_pdb
from plimsoll.operator.resources.inference_pool import (
    INFERENCE_POOL_GROUP_VERSION,
    INFERENCE_POOL_PLURAL,
    build_inference_pool,
    uses_inference_pool,
)
from plimsoll.operator.resources.kv_cache import kv_children, kv_server_name
from plimsoll.operator.resources.labels import MANAGED_BY
from plimsoll.operator.resources.leader_worker_set import LWS_GROUP_VERSION
from plimsoll.operator.resources.model_cache import (
    build_model_cache_daemonset,
    model_cache_name,
    wants_prefill,
)
from plimsoll.operator.resources.monitoring import (
    MONITORING_GROUP_VERSION,
    build_pod_monitor,
    build_prometheus_rule,
    build_service_monitor,
)
from plimsoll.operator.resources.network_policy import NETWORK_POLICY_API_VERSION, network_policies
from plimsoll.operator.resources.pools import build_prefill_deployment, prefill_name
from plimsoll.operator.resources.readiness import build_status, invalid_spec_status
from plimsoll.operator.resources.service import build_service
from plimsoll.operator.resources.settings import BuildSettings
from plimsoll.operator.resources.variants import combine_deployments


@dataclass(frozen=True)
class Outcome:
    """What one reconcile did, for logs and tests."""

    created: tuple[str, ...]
    updated: tuple[str, ...]
    ready: bool


def _as_body(body: BodyLike) -> kopf.Body:
    # kopf's event/adopt helpers read plain mappings too (an owner fetched by GET).
    return cast(kopf.Body, body)


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem: `spec.scaling: scaling.min (3) must not exceed ...`."""
    parts = []
    for problem in error.errors():
        where = ".".join(["spec", *(str(p) for p in problem["loc"] if p != "spec")])
        parts.append(f"{where}: {problem['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)[:MAX_MESSAGE]


def parse(body: BodyLike) -> LLMService:
    """Validate an LLMService body; raises ValidationError for a spec the operator cannot serve."""
    return LLMService.from_body(body)


async def reject_invalid(kube: Kube, body: BodyLike, error: ValidationError) -> str:
    """Record an invalid spec (Ready=False, reason InvalidSpec, an Event) and return the message."""
    return await reject_unservable(kube, body, describe_validation_error(error))


async def reject_unservable(kube: Kube, body: BodyLike, message: str) -> str:
    """Record a spec this cluster cannot serve as InvalidSpec (an Event when it is new)."""
    meta = body["metadata"]
    message = message[:MAX_MESSAGE]

    def change(status: dict[str, Any]) -> dict[str, Any] | None:
        invalid = invalid_spec_status(meta.get("generation"), status, message)
        return invalid if status.get("conditions") != invalid["conditions"] else None

    seen = dict(body.get("status", {}) or {})
    if await update_status(kube, meta["namespace"], meta["name"], change, seen=seen) is not None:
        kopf.warn(_as_body(body), reason="InvalidSpec", message=message)
    return message


async def _apply_child(
    kube: Kube,
    body: BodyLike,
    obj: dict[str, Any],
    logger: Log,
) -> tuple[str | None, dict[str, Any]]:
    """Apply one child; return ("created"|"updated"|None, the object as stored).

    Raises OwnershipConflict, having changed nothing, when an object of that name exists
    and is not this LLMService's.
    """
    kopf.adopt(obj, owner=_as_body(body))
    meta = obj["metadata"]
    before = await existing_owned(kube, body, obj)
    label = f"{obj['kind']} {meta['name']}"
    try:
        after = await kube.apply(obj)
    except ApiException as error:
        if error.status != 422 or before is None:
            raise
        # A hand edit left list entries that clash with ours once merged (two ports
        # named "http"): put our lists back whole, then apply again to own the fields.
        logger.info("apply of %s refused (%s); replacing its lists", label, error.reason)
        await kube.replace_lists(obj)
        after = await kube.apply(obj)
    # ServiceAccounts, Roles and RoleBindings have no spec to compare.
    if "spec" in obj and not contains(obj["spec"], after.get("spec")):
        logger.info(
            "%s still differs from its spec after apply (a list entry added by hand); replacing lists", label
        )
        after = await kube.replace_lists(obj)
    if before is None:
        logger.info("created %s", label)
        return "created", after
    if before["metadata"].get("resourceVersion") != after["metadata"].get("resourceVersion"):
        logger.info("updated %s", label)
        return "updated", after
    return None, after


async def reconcile(kube: Kube, body: BodyLike, settings: BuildSettings, logger: Log) -> Outcome:
    """Bring the children and status of one LLMService in line with its spec.

    Raises ValidationError (after recording InvalidSpec) when the spec cannot be
    served; callers turn that into kopf.PermanentError so kopf does not retry it.
    Each pass is one ``reconcile`` span (what it created and updated, whether Ready).
    """
    meta = body.get("metadata") or {}
    with llmservice_span("reconcile", str(meta.get("namespace", "")), str(meta.get("name", ""))) as span:
        outcome = await _reconcile(kube, body, settings, logger)
        span.set_attributes({
            "plimsoll.reconcile.created": list(outcome.created),
            "plimsoll.reconcile.updated": list(outcome.updated),
            "plimsoll.reconcile.ready": outcome.ready,
        })
        return outcome


async def _reconcile(kube: Kube, body: BodyLike, settings: BuildSettings, logger: Log) -> Outcome:
    try:
        svc = parse(body)
    except ValidationError as error:
        await reject_invalid(kube, body, error)
        raise
    # No spec.replicas yet: size from expectedLoad (or seed it for an HPA) before the Deployment is built.
    svc = await size_new_service(kube, body, svc, kopf_events(body), logger)

    workload = await replica_workload(kube, svc, settings, logger)
    if workload.removed:
        kopf.info(_as_body(body), reason="Deleted", message=f"deleted {workload.removed} (resources.nodes changed)")
    if workload.obj is None:
        # Not the user's typo but a missing API: nothing is created until it is installed,
        # and the periodic pass picks it up then without a spec edit.
        await reject_unservable(kube, body, workload.unservable or "the replicas cannot be built")
        return Outcome((), (), False)
    replicas = workload.obj
    conflicts: list[str] = []
    try:
        # Before the pods: they read the admin key (and Ray's token) from this Secret.
        if await ensure_credentials(kube, body, svc):
            kopf.info(_as_body(body), reason="Created", message=f"created Secret/{admin_secret_name(svc)}")
    except OwnershipConflict as conflict:
        logger.warning("%s; left untouched", conflict)
        conflicts.append(conflict.label)
    children = [replicas, build_service(svc), build_pdb(svc)]
    variant_objs: list[dict[str, Any]] = []
    if svc.spec.variants:
        # One Deployment per hardware variant in place of the one above (variant_workloads.py). One that
        # does not exist yet is created by the replica planner's handler with its first count; all are
        # then applied here without a count.
        work = await variant_workloads(kube, svc, settings, logger)
        await start_variant_deployments(kube, body, svc, work.missing, logger)
        for removed in work.removed:
            kopf.info(_as_body(body), reason="Deleted", message=f"deleted {removed}")
        variant_objs = work.objs
        children = [*variant_objs, *children[1:]]
    elif (body.get("status") or {}).get("variants"):
        for removed in await remove_variant_workloads(kube, svc, logger):
            kopf.info(_as_body(body), reason="Deleted", message=f"deleted {removed} (spec.variants is empty)")
    policies = network_policies(svc, settings)
    children.extend(policies)
    # networkPolicy.enabled false: remove what it made. (A `<name>-kv` policy left after the operator's
    # Valkey went selects no pod; it goes with the LLMService.)
    for unused in () if policies else (svc.name, kv_server_name(svc)):
        if await delete_owned(kube, body, NETWORK_POLICY_API_VERSION, "NetworkPolicy", svc.namespace, unused):
            kopf.info(_as_body(body), reason="Deleted", message=f"deleted NetworkPolicy/{unused}")
    if await kube.has_resource(MONITORING_GROUP_VERSION, "podmonitors"):
        children.append(build_pod_monitor(svc))
    elif await kube.has_resource(MONITORING_GROUP_VERSION, "servicemonitors"):
        children.append(build_service_monitor(svc))
    if await kube.has_resource(MONITORING_GROUP_VERSION, "prometheusrules"):
        # Thresholds follow status.capacity, so a new profile updates the rule on the next pass.
        children.append(build_prometheus_rule(svc, (body.get("status") or {}).get("capacity")))
    children.extend(router_children(svc, settings))
    prefill_pool = build_prefill_deployment(svc, settings) if svc.spec.disaggregation is not None else None
    if prefill_pool is not None:
        children.append(prefill_pool)  # the prefill pool of a split service (its decode pool is `replicas`)
    elif await remove_prefill_pool(kube, svc, logger):
        kopf.info(_as_body(body), reason="Deleted", message=f"deleted Deployment/{prefill_name(svc)} (no longer split)")
    children.extend(kv_children(svc))  # the shared KV tier's Valkey, when spec.kvCache.shared deploys one
    if wants_prefill(svc):
        children.append(build_model_cache_daemonset(svc, settings))  # fills model.cache.hostPath on the nodes
    elif await delete_owned(kube, body, "apps/v1", "DaemonSet", svc.namespace, model_cache_name(svc)):
        kopf.info(
            _as_body(body),
            reason="Deleted",
            message=f"deleted DaemonSet/{model_cache_name(svc)} (no prefill)",
        )
    if uses_inference_pool(svc):
        if await kube.has_resource(INFERENCE_POOL_GROUP_VERSION, INFERENCE_POOL_PLURAL):
            children.append(build_inference_pool(svc))
        else:
            kopf.warn(
                _as_body(body),
                reason="InferencePoolUnavailable",
                message="router.mode is inferencePool but inferencepools.inference.networking.k8s.io "
                "is not served; install the Gateway API Inference Extension CRDs",
            )
    elif await remove_unused_inference_pool(kube, svc, logger):
        kopf.info(
            _as_body(body),
            reason="Deleted",
            message=f"deleted InferencePool/{svc.name} (router.mode plimsoll)",
        )
    await remove_disabled_router(kube, body, svc, settings, logger)

    created: list[str] = []
    updated: list[str] = []
    deployment: dict[str, Any] | None = None
    prefill: dict[str, Any] | None = None
    variant_stored: list[dict[str, Any]] = []
    try:
        for child in children:
            try:
                change, stored = await _apply_child(kube, body, child, logger)
            except OwnershipConflict as conflict:
                # Someone else's object of this name: left as it is, reported below, the rest applied.
                logger.warning("%s; left untouched", conflict)
                conflicts.append(conflict.label)
                continue
            except ApiException as error:
                optional = (MONITORING_GROUP_VERSION, INFERENCE_POOL_GROUP_VERSION, LWS_GROUP_VERSION)
                if error.status != 404 or child["apiVersion"] not in optional:
                    raise
                # An optional CRD (Prometheus operator, InferencePool) was removed after
                # discovery was cached: skip the object and look again on the next pass.
                kube.forget_resources(child["apiVersion"])
                logger.warning("%s is no longer served; skipped", child["kind"])
                continue
            label = f"{child['kind']}/{child['metadata']['name']}"
            if change == "created":
                created.append(label)
            elif change == "updated":
                updated.append(label)
            if child is replicas:  # status follows the replicas, not the router's Deployment
                deployment = stored
            elif child is prefill_pool:
                prefill = stored
            elif any(child is v for v in variant_objs):
                variant_stored.append(stored)
    finally:
        # Said even when a later child fails: a retry finds these in place and would not say it.
        if created:
            kopf.info(_as_body(body), reason="Created", message="created " + ", ".join(created))
        if updated:
            kopf.info(
                _as_body(body),
                reason="Updated",
                message="brought back in line with the spec: " + ", ".join(updated),
            )
    try:
        # After the children: it sets ScalingLimited on the freshest copy, so neither overwrites the other.
        await ensure_external_autoscaler(kube, body, svc, logger)
    except OwnershipConflict as conflict:
        logger.warning("%s; left untouched", conflict)
        conflicts.append(conflict.label)
    if conflicts:
        # Ready=False naming the objects; the replicas' status is not ours to read from another's Deployment.
        await report_conflicts(kube, body, conflicts)
        return Outcome(tuple(created), tuple(updated), False)
    if variant_objs:
        deployment = combine_deployments(variant_stored)
    ready = await write_status(kube, body, svc, deployment, prefill)
    if has_conflict(body):  # clear it once the objects are gone or renamed (no read otherwise)
        await report_conflicts(kube, body, [])
    await report_model_download(kube, body, svc, logger)
    # Adapters are loaded through the replicas' API, not the pod template: a change never rolls the pods.
    await sync_adapters(kube, body, svc, logger)
    return Outcome(tuple(created), tuple(updated), ready)


async def remove_prefill_pool(kube: Kube, svc: LLMService, logger: Log) -> bool:
    """Delete the prefill pool's Deployment of a service no longer split (only one the operator made)."""
    existing = await kube.get("apps/v1", "Deployment", svc.namespace, prefill_name(svc))
    labels = ((existing or {}).get("metadata") or {}).get("labels") or {}
    if existing is None or labels.get("app.kubernetes.io/managed-by") != MANAGED_BY:
        return False
    await kube.delete("apps/v1", "Deployment", svc.namespace, prefill_name(svc))
    logger.info("deleted Deployment %s: spec.disaggregation is gone", prefill_name(svc))
    return True


async def write_status(
    kube: Kube, body: BodyLike, svc: LLMService, deployment: dict[str, Any] | None,
    prefill: dict[str, Any] | None = None,
) -> bool:
    """Patch status from the Deployment when it changed; Event on a Ready transition. Returns Ready."""
    router = await current_router(kube, svc)

    def change(status: dict[str, Any]) -> dict[str, Any]:
        built: dict[str, Any] = build_status(svc, deployment, status, router=router, prefill=prefill)
        return built

    seen = dict(body.get("status", {}) or {})
    written = await update_status(kube, svc.namespace, svc.name, change, seen=seen)
    if written is None:
        # Nothing to write: Ready is what the stored status already says.
        ready_now = next(c for c in change(seen)["conditions"] if c["type"] == "Ready")
        return bool(ready_now["status"] == "True")
    slo_now, slo_before = written.patch.get("slo") or {}, written.before.get("slo") or {}
    if slo_now.get("source", "").startswith("preset:") and slo_before.get("source") != slo_now["source"]:
        kopf.info(_as_body(body), reason="SLODefaulted", message=slo_now["message"])
    ready_now = next(c for c in written.patch["conditions"] if c["type"] == "Ready")
    ready_before = written.condition_before("Ready")
    if ready_before is None or ready_before.get("status") != ready_now["status"]:
        kopf.info(
            _as_body(body),
            reason=ready_now["reason"],
            message=f"Ready={ready_now['status']}: {ready_now['message']}",
        )
    return bool(ready_now["status"] == "True")
