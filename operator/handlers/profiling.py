"""Capacity profiling: run a benchmark Job against one replica and record what it measured.

What it is: a kopf timer on every LLMService (``PROFILE_INTERVAL_S``, default 5 s)
that looks at what exists in the cluster — the service's profile Jobs (labelled,
annotated with the spec hash they measure), their report ConfigMaps, the replica
pods, ``status.capacity`` and the ``plimsoll.dev/reprofile`` annotation — and takes
the one next step :func:`plimsoll.operator.scaling.profile_plan.decide` names: start a Job, record a finished one, delete
an obsolete one, or only bring the ``Profiled`` / ``ProfileStale`` conditions up to
date. Nothing is kept in memory, so a restarted operator carries on where the
last one stopped; a Job's outcome is recorded once (the Job gets the annotation
``plimsoll.dev/profile-recorded``).

Rules: ``capacity.mode: Manual`` gives ``Profiled=False, reason ManualCapacity``
(the autoscaler takes ``concurrencyPerReplica`` from the spec) and never runs a
Job. A failed Job or an invalid report gives ``Profiled=False`` with the reason
and a Warning Event, and no capacity; it is retried only when the failed Job is
gone (its ``ttlSecondsAfterFinished`` is the back-off) or on the annotation.
A capacity measured for another spec hash gives ``ProfileStale=True``; with
``capacity.reprofile: Auto`` a new Job starts at once, with ``OnAnnotation`` when
the user sets ``plimsoll.dev/reprofile``. The pod measured must run the current
pod template, so a profile never measures a replica of the old spec.

What it is not: the decision (``operator/scaling/profile_plan.py``), the report
reader (``operator/scaling/profile.py``) or the Job builder
(``operator/resources/profile_job.py``). Only the ``Profiled`` and
``ProfileStale`` conditions and ``status.capacity`` are written here, through
``status_writer.py`` (fresh copy, resourceVersion precondition), so a concurrent
writer's conditions are never overwritten with a stale copy. Importing this
module registers the timer.
"""

import os
from collections.abc import Sequence
from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import ValidationError

from plimsoll.operator.api.base import API_VERSION, GROUP, KIND, PLURAL, VERSION
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import ConditionUpdate
from plimsoll.operator.handlers.handler_types import Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.ownership import (
    OWNERSHIP_CONDITION,
    OwnershipConflict,
    apply_owned,
    conflict_message,
    delete_owned,
    existing_owned,
    owned_by,
)
from plimsoll.operator.handlers.status_writer import MAX_MESSAGE, set_conditions
from plimsoll.operator.handlers.variant_status import record_variant_profile
from plimsoll.operator.resources.engine import engine_container, engine_image
from plimsoll.operator.resources.labels import LLMSERVICE_LABEL, selector_string
from plimsoll.operator.resources.pool_view import ROLE_LABEL, Role
from plimsoll.operator.resources.profile_job import (
    PROFILE_COMPONENT,
    REPORT_KEY,
    SPEC_HASH_ANNOTATION,
    ProfileArgsError,
    build_profile_job,
    build_profiler_rbac,
    build_report_configmap,
)
from plimsoll.operator.resources.settings import BuildSettings
from plimsoll.operator.resources.variants import label_variant
from plimsoll.operator.scaling.inputs import spec_profile_hash
from plimsoll.operator.scaling.profile import CapacityProfile, profile_conditions, read_profile
from plimsoll.operator.scaling.profile_plan import REPROFILE_ANNOTATION, JobState, JobView, Plan, decide
from plimsoll.pods import pod_is_ready

RECORDED_ANNOTATION = "plimsoll.dev/profile-recorded"
PROFILE_INTERVAL_S = float(os.environ.get("PLIMSOLL_PROFILE_INTERVAL_SECONDS", "5"))


# --- reading the cluster ---------------------------------------------------------------


def _job_state(job: dict[str, Any]) -> JobState:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("status") == "True" and c.get("type") in ("Complete", "SuccessCriteriaMet"):
            return "Succeeded"
        if c.get("status") == "True" and c.get("type") in ("Failed", "FailureTarget"):
            return "Failed"
    return "Running"


def _view(job: dict[str, Any]) -> JobView:
    meta = job["metadata"]
    annotations = meta.get("annotations") or {}
    return JobView(
        name=meta["name"],
        spec_hash=annotations.get(SPEC_HASH_ANNOTATION, ""),
        state=_job_state(job),
        recorded=RECORDED_ANNOTATION in annotations,
    )


def _profile_selector(svc: LLMService) -> str:
    return f"{LLMSERVICE_LABEL}={svc.name},app.kubernetes.io/component={PROFILE_COMPONENT}"


async def list_profile_jobs(kube: Kube, svc: LLMService) -> dict[str, dict[str, Any]]:
    jobs = await kube.list_objects("batch/v1", "Job", svc.namespace, label_selector=_profile_selector(svc))
    # Labels can be copied; only Jobs this LLMService owns are read, recorded or deleted.
    return {
        j["metadata"]["name"]: j
        for j in jobs
        if not j["metadata"].get("deletionTimestamp") and owned_by(j, svc)
    }


def current_replica_ip(
    svc: LLMService, settings: BuildSettings, pods: list[dict[str, Any]], role: Role = "decode"
) -> str | None:
    """The IP of a Ready replica whose engine container is the one the spec asks for now (pure); on a
    split service, one of pool ``role``'s."""
    want, _ = engine_container(svc, settings, role)
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        status = pod.get("status") or {}
        ready = pod_is_ready(pod)
        engine: dict[str, Any] = next(
            (c for c in pod["spec"].get("containers", []) if c.get("name") == want["name"]), {}
        )
        current = engine.get("image") == want["image"] and engine.get("args") == want["args"]
        if ready and current and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            return str(status["podIP"])
    return None


# --- writing -----------------------------------------------------------------------------


async def patch_profile_status(
    kube: Kube,
    svc: LLMService,
    conditions: tuple[ConditionUpdate, ...],
    capacity: dict[str, Any] | None = None,
    variant: str | None = None,
) -> bool:
    """Set only our conditions (and capacity) on the freshest copy; True when something changed.

    For one hardware variant (``variant``) the capacity and the Profiled verdict go to
    ``status.variants.<variant>``; ``variant_profiling.py`` sums the conditions up.
    """
    if variant is not None:
        return await record_variant_profile(kube, svc, variant, conditions, capacity)
    fields = {"capacity": capacity} if capacity is not None else None
    changed: bool = await set_conditions(
        kube, svc.namespace, svc.name, conditions, svc.metadata.generation, fields=fields
    )
    return changed


async def start_job(
    kube: Kube,
    body: kopf.Body,
    svc: LLMService,
    settings: BuildSettings,
    spec_hash: str,
    pod_ip: str,
    why: str,
    variant: str | None = None,
    role: Role | None = None,
    running: Sequence[str] = (),
) -> dict[str, Any]:
    """Create the RBAC, a fresh report ConfigMap and the Job (of one hardware variant, or one pool
    ``role`` of a split service, whose other ``running`` Jobs keep their report writable); returns the Job.

    Every object goes through the ownership checks: a name another owner holds is a conflict, never
    overwritten or deleted."""
    job = build_profile_job(svc, pod_ip, settings, spec_hash)
    if variant is not None:
        label_variant(job, variant)
    if role is not None:
        # The Job only: its pod carries the service's instance label, and a role label on it would make
        # the router discover the benchmark as a replica of the pool.
        job["metadata"].setdefault("labels", {})[ROLE_LABEL] = role
    name: str = job["metadata"]["name"]
    for obj in build_profiler_rbac(svc, name, *running):  # ServiceAccount, Role, RoleBinding
        await apply_owned(kube, body, obj)  # OwnershipConflict, nothing touched, when a name is taken
    # A report left by an earlier attempt for the same spec must not be read as this one's.
    await delete_owned(kube, body, "v1", "ConfigMap", svc.namespace, name)
    report = build_report_configmap(svc, spec_hash)
    try:
        await kube.create(report)
    except ApiException as error:
        if error.status != 409:
            raise
        await existing_owned(kube, body, report)  # someone else's ConfigMap of that name: a conflict
        raise
    try:
        await kube.create(job)
    except ApiException as error:
        if error.status != 409:
            raise
        await existing_owned(kube, body, job)
        # Still being deleted (a re-profile of the same spec): try again on the next tick.
        raise kopf.TemporaryError(
            f"Job {name} still exists; starting the new profile shortly", delay=5
        ) from error
    which = f"{role} replica" if role is not None else "replica"
    kopf.info(body, reason="ProfilingStarted", message=f"Job {name} measures {which} {pod_ip} ({why})")
    return job


async def record_job(
    kube: Kube, body: kopf.Body, svc: LLMService, job: dict[str, Any], logger: Log, variant: str | None = None
) -> None:
    """Turn a finished Job into status.capacity + Profiled=True, or Profiled=False + a Warning.

    For a hardware variant (``svc`` as that variant sees it) into ``status.variants.<variant>``,
    with the request rate one replica carries at its target, the unit variants are compared in.
    """
    ns, name = svc.namespace, job["metadata"]["name"]
    spec_hash = job["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    result: CapacityProfile | tuple[str, str]
    if _job_state(job) == "Failed":
        result = ("ProfileJobFailed", f"benchmark Job {name} failed: {await _failure_detail(kube, ns, job)}")
    else:
        cm = await kube.get("v1", "ConfigMap", ns, name) or {}
        report = (cm.get("data") or {}).get(REPORT_KEY)
        if report is None:
            result = (
                "NoReport",
                f"benchmark Job {name} succeeded but left no {REPORT_KEY} in ConfigMap {name}",
            )
        else:
            parsed = read_profile(report)
            result = parsed if isinstance(parsed, CapacityProfile) else (parsed.reason, parsed.message)

    if isinstance(result, CapacityProfile):
        measured_at = (job.get("status") or {}).get("completionTime")
        measured = {**result.measured(), **await _where_it_ran(kube, svc, job)}
        capacity = {
            "knees": result.knees(),
            "curve": result.curve() or None,
            "concurrencyPerReplica": result.concurrency_per_replica,
            "workload": result.workload or {},
            "measuredAt": measured_at,
            "specHash": spec_hash,
            "verification": result.verification_status(),
            "disturbedLevels": list(result.disturbed) or None,
            "measured": measured,
        }
        if variant is not None:
            capacity["requestsPerSecondPerReplica"] = result.requests_per_second()
        conditions, warning = profile_conditions(result, name, spec_hash)
        message = conditions[0][3] + (
            f"; {measured['requests']} requests over {measured['seconds']:g} s in {len(measured['levels'])} levels"
        )
        if measured.get("sameNode"):
            shared = (
                f"the load generator ran on the replica's own node {measured['replicaNode']} (no other node "
                "could take it), so the knees may sit low; re-profile when another node is free"
            )
            message += f"; {shared}"
            warning = f"{warning}; {shared}" if warning else shared
        conditions = ((*conditions[0][:3], message), *conditions[1:])
        await patch_profile_status(
            kube,
            svc,
            conditions,
            capacity={k: v for k, v in capacity.items() if v is not None},
            variant=variant,
        )
        if variant is not None:
            message = f"variant {variant}: {message}"
        kopf.info(body, reason="Profiled", message=message[:MAX_MESSAGE])
        if warning is not None:
            kopf.warn(body, reason="ProfileDisturbed", message=warning[:MAX_MESSAGE])
        logger.info("profiled: %s", message)
    else:
        reason, message = result
        await patch_profile_status(kube, svc, (("Profiled", "False", reason, message),), variant=variant)
        kopf.warn(body, reason="ProfileFailed", message=f"{reason}: {message}"[:MAX_MESSAGE])
        logger.warning("profile failed: %s: %s", reason, message)
    await kube.merge_patch(
        "batch/v1", "Job", ns, name, {"metadata": {"annotations": {RECORDED_ANNOTATION: "true"}}}
    )


async def _where_it_ran(kube: Kube, svc: LLMService, job: dict[str, Any]) -> dict[str, Any]:
    """The nodes of the Job's pod and of the replica it measured (by the IP in its --url)."""
    ns = svc.namespace
    pods = await kube.list_objects("v1", "Pod", ns, label_selector=f"job-name={job['metadata']['name']}")
    generator = next((p["spec"].get("nodeName") for p in pods if p["spec"].get("nodeName")), None)
    containers = job["spec"]["template"]["spec"].get("containers") or [{}]
    args = containers[0].get("args") or []
    url = args[args.index("--url") + 1] if "--url" in args else ""
    ip = url.removeprefix("http://").rsplit(":", 1)[0]
    replicas = await kube.list_objects("v1", "Pod", ns, label_selector=selector_string(svc))
    replica = next(
        (p["spec"].get("nodeName") for p in replicas if (p.get("status") or {}).get("podIP") == ip), None
    )
    where: dict[str, Any] = {"loadGeneratorNode": generator, "replicaNode": replica}
    if generator and replica:
        where["sameNode"] = generator == replica
    return where


async def _failure_detail(kube: Kube, ns: str, job: dict[str, Any]) -> str:
    """The Job's Failed condition, plus the container's termination message (its log tail) when there is one."""
    failed: dict[str, Any] = next(
        (c for c in (job.get("status") or {}).get("conditions") or [] if c.get("type") == "Failed"), {}
    )
    detail = f"{failed.get('reason', 'Failed')}: {failed.get('message', '')}".strip()
    pods = await kube.list_objects("v1", "Pod", ns, label_selector=f"job-name={job['metadata']['name']}")
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (cs.get("state") or {}).get("terminated") or {}
            if terminated:
                detail += f"; exit code {terminated.get('exitCode')}"
                if terminated.get("message"):
                    detail += f": {terminated['message'].strip()[-400:]}"
    return detail


# --- the timer ---------------------------------------------------------------------------


async def profile_step(kube: Kube, body: kopf.Body, settings: BuildSettings, logger: Log) -> Plan:
    """One pass: observe, decide, act. Returns the plan taken (for logs and tests)."""
    svc = LLMService.from_body(body)
    if svc.spec.disaggregation is not None:
        from plimsoll.operator.handlers.pool_profiling import profile_pools

        return await profile_pools(kube, body, svc, settings, logger)
    if svc.spec.variants:
        # One profile per hardware variant; imported here, as that module builds on this one.
        from plimsoll.operator.handlers.variant_profiling import profile_variants

        await profile_variants(kube, body, svc, settings, logger)
        return Plan()
    current_hash = spec_profile_hash(svc.spec, engine_image(svc, settings))
    capacity_hash = ((body.get("status") or {}).get("capacity") or {}).get("specHash")
    jobs = await list_profile_jobs(kube, svc)
    pods = await kube.list_objects("v1", "Pod", svc.namespace, label_selector=selector_string(svc))
    pod_ip = current_replica_ip(svc, settings, pods)
    plan = decide(svc, current_hash, capacity_hash, [_view(j) for j in jobs.values()], pod_ip is not None)

    for name in plan.delete:
        if await delete_owned(kube, body, "batch/v1", "Job", svc.namespace, name):
            logger.info("deleted profile Job %s (obsolete)", name)
    conditions = plan.conditions
    if plan.start is not None and pod_ip is not None:
        try:
            await start_job(kube, body, svc, settings, current_hash, pod_ip, plan.start)
        except ProfileArgsError as error:
            conditions = (("Profiled", "False", "InvalidProfileArgs", str(error)),)
            if await patch_profile_status(kube, svc, conditions):
                kopf.warn(body, reason="ProfileFailed", message=str(error))
            return plan
        except OwnershipConflict as conflict:
            message = conflict_message([conflict.label])
            conditions = (("Profiled", "False", OWNERSHIP_CONDITION, message),)
            if await patch_profile_status(kube, svc, conditions):
                kopf.warn(body, reason=OWNERSHIP_CONDITION, message=message)
            return plan
    if plan.record is not None:
        await record_job(kube, body, svc, jobs[plan.record], logger)
    if plan.clear_annotation:
        await kube.merge_patch(
            API_VERSION,
            KIND,
            svc.namespace,
            svc.name,
            {"metadata": {"annotations": {REPROFILE_ANNOTATION: None}}},
        )
    if conditions:
        changed = await patch_profile_status(kube, svc, conditions)
        stale = next((c for c in conditions if c[0] == "ProfileStale"), None)
        if changed and stale is not None and stale[1] == "True":
            kopf.info(body, reason="ProfileStale", message=stale[3])
    return plan


@kopf.timer(GROUP, VERSION, PLURAL, interval=PROFILE_INTERVAL_S, initial_delay=1.0)
async def profile_llmservice(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Keep the capacity profile of one LLMService current (see the module docstring)."""
    if body.get("metadata", {}).get("deletionTimestamp"):
        return
    try:
        await profile_step(memo.kube, body, memo.build, logger)
    except ValidationError:
        return  # reported by reconcile as InvalidSpec
    except ApiException as error:
        if error.status == 404:
            return  # the LLMService or its namespace is going away
        logger.warning("profiling step failed: %s %s", error.status, error.reason)
