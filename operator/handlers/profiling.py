"""Capacity profiling: run a benchmark Job against one replica and record what it measured.

What it is: a kopf timer on every LLMService (``PROFILE_INTERVAL_S``, default 5 s)
that looks at what exists in the cluster — the service's profile Jobs (labelled,
annotated with the spec hash they measure), their report ConfigMaps, the replica
pods, ``status.capacity`` and the ``plimsoll.dev/reprofile`` annotation — and takes
the one next step :func:`decide` names: start a Job, record a finished one, delete
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

What it is not: the report reader (``operator/scaling/profile.py``) or the Job
builder (``operator/resources/profile_job.py``). Only the ``Profiled`` and
``ProfileStale`` conditions and ``status.capacity`` are written here, with the
object's resourceVersion as a precondition, so a concurrent writer's conditions
are never overwritten with a stale copy. Importing this module registers the timer.
"""

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import kopf
from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import ValidationError

from plimsoll.operator.api.base import API_VERSION, GROUP, PLURAL, VERSION
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import ConditionStatus, ConditionType, set_condition
from plimsoll.operator.handlers.kube import FIELD_MANAGER, Kube
from plimsoll.operator.resources.engine import engine_container
from plimsoll.operator.resources.labels import LLMSERVICE_LABEL, selector_string
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
from plimsoll.operator.scaling.inputs import spec_profile_hash
from plimsoll.operator.scaling.profile import CapacityProfile, fmt_opt, read_profile

REPROFILE_ANNOTATION = "plimsoll.dev/reprofile"
RECORDED_ANNOTATION = "plimsoll.dev/profile-recorded"
PROFILE_INTERVAL_S = float(os.environ.get("PLIMSOLL_PROFILE_INTERVAL_SECONDS", "5"))
_MAX_MESSAGE = 1000

JobState = Literal["Running", "Succeeded", "Failed"]
Log = logging.Logger | logging.LoggerAdapter[Any]


@dataclass(frozen=True, slots=True)
class JobView:
    """What the decision needs to know about one profile Job."""

    name: str
    spec_hash: str
    state: JobState
    recorded: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    """The next step for one LLMService; at most one of start/record is set."""

    conditions: tuple[tuple[ConditionType, ConditionStatus, str, str], ...] = ()
    start: str | None = None  # why a Job starts (for the Event)
    record: str | None = None  # the finished Job whose outcome to record
    delete: tuple[str, ...] = ()
    clear_annotation: bool = False
    events: tuple[tuple[str, str], ...] = field(default=())  # (reason, message), Normal


def decide(
    svc: LLMService,
    current_hash: str,
    capacity_hash: str | None,
    jobs: list[JobView],
    has_ready_pod: bool,
) -> Plan:
    """The next profiling step for ``svc``, from what exists (pure; see the module docstring)."""
    requested = REPROFILE_ANNOTATION in svc.metadata.annotations
    capacity = svc.spec.capacity
    running = [j for j in jobs if j.state == "Running"]
    if capacity.mode == "Manual":
        message = (
            f"capacity.mode Manual: {capacity.concurrency_per_replica} concurrent requests per replica "
            "from the spec; no benchmark runs"
        )
        return Plan(
            conditions=(
                ("Profiled", "False", "ManualCapacity", message),
                ("ProfileStale", "False", "ManualCapacity", "no profile is used in Manual mode"),
            ),
            delete=tuple(j.name for j in running),
            clear_annotation=requested,
        )

    obsolete = tuple(j.name for j in running if j.spec_hash != current_hash)
    stale = capacity_hash is not None and capacity_hash != current_hash
    if stale:
        how = (
            "re-profiling automatically (capacity.reprofile Auto)"
            if capacity.reprofile == "Auto"
            else f"annotate the LLMService with {REPROFILE_ANNOTATION}=<anything> to re-measure"
        )
        stale_condition: tuple[ConditionType, ConditionStatus, str, str] = (
            "ProfileStale", "True", "SpecChanged",
            f"the capacity was measured on spec {capacity_hash}, the spec is now {current_hash}; {how}",
        )  # fmt: skip
    elif capacity_hash is None:
        stale_condition = ("ProfileStale", "False", "NotProfiled", "no capacity has been measured yet")
    else:
        stale_condition = (
            "ProfileStale",
            "False",
            "ProfileCurrent",
            f"measured on the current spec {current_hash}",
        )

    job = next((j for j in jobs if j.spec_hash == current_hash), None)
    if job is not None and job.state == "Running":
        return Plan(
            conditions=(
                ("Profiled", "False", "Profiling", f"benchmark Job {job.name} is measuring one replica"),
                stale_condition,
            ),
            delete=obsolete,
            clear_annotation=requested,  # the Job it asked for is running
        )
    if job is not None and not job.recorded:
        # Recording writes both conditions itself, from the Job it reads.
        return Plan(record=job.name, delete=obsolete)

    if requested:
        why = f"annotation {REPROFILE_ANNOTATION}"
    elif job is not None:
        # A recorded Job for this spec: success is in status, a failure waits for the back-off.
        return Plan(conditions=(stale_condition,), delete=obsolete)
    elif capacity_hash == current_hash:
        return Plan(conditions=(stale_condition,), delete=obsolete)
    elif capacity_hash is None:
        why = "no capacity measured yet"
    elif capacity.reprofile == "Auto":
        why = "the profile is stale (engine, model, image or GPU changed)"
    else:
        return Plan(conditions=(stale_condition,), delete=obsolete)

    if not has_ready_pod:
        waiting: tuple[tuple[ConditionType, ConditionStatus, str, str], ...] = (stale_condition,)
        if capacity_hash is None:
            waiting = (
                ("Profiled", "False", "WaitingForReplica", "profiling starts once a replica on the current spec is Ready"),
                stale_condition,
            )  # fmt: skip
        return Plan(conditions=waiting, delete=obsolete)
    return Plan(
        conditions=(("Profiled", "False", "Profiling", f"starting a benchmark Job ({why})"), stale_condition),
        start=why,
        delete=tuple(sorted({*obsolete, *(j.name for j in jobs if j.spec_hash == current_hash)})),
        clear_annotation=requested,
    )


# --- reading the cluster ---------------------------------------------------------------


async def _call(kube: Kube, method: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
    query: list[tuple[str, str]] = kw.pop("query", [])
    content_type: str = kw.pop("content_type", "application/json")
    result = await kube.api.call_api(
        path, method, query_params=query,
        header_params={"Content-Type": content_type, "Accept": "application/json"},
        body=body, response_types_map={200: "object", 201: "object", 202: "object"},
        auth_settings=["BearerToken"], _return_http_data_only=True, _request_timeout=30,
    )  # fmt: skip
    return result if isinstance(result, dict) else {}


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
    listing = await _call(
        kube,
        "GET",
        f"/apis/batch/v1/namespaces/{svc.namespace}/jobs",
        query=[("labelSelector", _profile_selector(svc))],
    )
    return {
        j["metadata"]["name"]: j
        for j in listing.get("items", [])
        if not j["metadata"].get("deletionTimestamp")
    }


def current_replica_ip(svc: LLMService, settings: BuildSettings, pods: list[dict[str, Any]]) -> str | None:
    """The IP of a Ready replica whose engine container is the one the spec asks for now (pure)."""
    want, _ = engine_container(svc, settings)
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        engine: dict[str, Any] = next(
            (c for c in pod["spec"].get("containers", []) if c.get("name") == want["name"]), {}
        )
        current = engine.get("image") == want["image"] and engine.get("args") == want["args"]
        if ready and current and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            return str(status["podIP"])
    return None


def _engine_image(svc: LLMService, settings: BuildSettings) -> str:
    default = settings.plimsoll_image if svc.spec.engine.kind == "plimsoll" else settings.vllm_image
    return str(svc.spec.engine.image or default)


# --- writing -----------------------------------------------------------------------------


async def patch_profile_status(
    kube: Kube,
    svc: LLMService,
    conditions: tuple[tuple[ConditionType, ConditionStatus, str, str], ...],
    capacity: dict[str, Any] | None = None,
) -> bool:
    """Set only our conditions (and capacity) on the freshest copy; True when something changed.

    The patch carries the resourceVersion it was computed from: if reconcile or the
    autoscaler wrote in between, the API server answers 409 and we recompute, rather
    than write back their conditions as they were before.
    """
    path = f"/apis/{API_VERSION}/namespaces/{svc.namespace}/{PLURAL}/{svc.name}"
    for _ in range(5):
        obj = await _call(kube, "GET", path)
        status = obj.get("status") or {}
        before = list(status.get("conditions") or [])
        merged = before
        for type_, state, reason, message in conditions:
            merged = set_condition(
                merged,
                type_,
                state,
                reason,
                message[:_MAX_MESSAGE],
                observed_generation=svc.metadata.generation,
            )
        if merged == before and (capacity is None or status.get("capacity") == capacity):
            return False
        patch: dict[str, Any] = {
            "metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
            "status": {"conditions": merged, **({"capacity": capacity} if capacity is not None else {})},
        }
        try:
            await _call(kube, "PATCH", path + "/status", patch, content_type="application/merge-patch+json")
            return True
        except ApiException as error:
            if error.status != 409:
                raise
    raise kopf.TemporaryError("status kept changing under the profiler; retrying", delay=2)


async def _apply(kube: Kube, path: str, obj: dict[str, Any]) -> None:
    await _call(
        kube, "PATCH", f"{path}/{obj['metadata']['name']}", obj,
        query=[("fieldManager", FIELD_MANAGER), ("force", "true")], content_type="application/apply-patch+yaml",
    )  # fmt: skip


async def _delete(kube: Kube, path: str) -> None:
    try:
        await _call(kube, "DELETE", path, query=[("propagationPolicy", "Background")])
    except ApiException as error:
        if error.status != 404:
            raise


async def start_job(
    kube: Kube,
    body: kopf.Body,
    svc: LLMService,
    settings: BuildSettings,
    spec_hash: str,
    pod_ip: str,
    why: str,
) -> str:
    """Create the RBAC, a fresh report ConfigMap and the Job; returns the Job name."""
    ns = svc.namespace
    job = build_profile_job(svc, pod_ip, settings, spec_hash)
    name: str = job["metadata"]["name"]
    sa, role, binding = build_profiler_rbac(svc, name)
    await _apply(kube, f"/api/v1/namespaces/{ns}/serviceaccounts", sa)
    await _apply(kube, f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", role)
    await _apply(kube, f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", binding)
    # A report left by an earlier attempt for the same spec must not be read as this one's.
    await _delete(kube, f"/api/v1/namespaces/{ns}/configmaps/{name}")
    await _call(kube, "POST", f"/api/v1/namespaces/{ns}/configmaps", build_report_configmap(svc, spec_hash))
    try:
        await _call(kube, "POST", f"/apis/batch/v1/namespaces/{ns}/jobs", job)
    except ApiException as error:
        if error.status != 409:
            raise
        # Still being deleted (a re-profile of the same spec): try again on the next tick.
        raise kopf.TemporaryError(
            f"Job {name} still exists; starting the new profile shortly", delay=5
        ) from error
    kopf.info(body, reason="ProfilingStarted", message=f"Job {name} measures replica {pod_ip} ({why})")
    return name


async def record_job(kube: Kube, body: kopf.Body, svc: LLMService, job: dict[str, Any], logger: Log) -> None:
    """Turn a finished Job into status.capacity + Profiled=True, or Profiled=False + a Warning."""
    ns, name = svc.namespace, job["metadata"]["name"]
    spec_hash = job["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    result: CapacityProfile | tuple[str, str]
    if _job_state(job) == "Failed":
        result = ("ProfileJobFailed", f"benchmark Job {name} failed: {await _failure_detail(kube, ns, job)}")
    else:
        try:
            cm = await _call(kube, "GET", f"/api/v1/namespaces/{ns}/configmaps/{name}")
        except ApiException as error:
            if error.status != 404:
                raise
            cm = {}
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
        capacity = {
            "knees": result.knees(),
            "concurrencyPerReplica": result.concurrency_per_replica,
            "workload": result.workload or {},
            "measuredAt": measured_at,
            "specHash": spec_hash,
        }
        message = (
            f"{result.concurrency_per_replica} concurrent requests per replica (throughput knee "
            f"{fmt_opt(result.throughput_knee)}, latency knee {fmt_opt(result.latency_knee)}), Job {name}"
        )
        await patch_profile_status(
            kube, svc,
            (("Profiled", "True", "ProfileMeasured", message),
             ("ProfileStale", "False", "ProfileCurrent", f"measured on the current spec {spec_hash}")),
            capacity={k: v for k, v in capacity.items() if v is not None},
        )  # fmt: skip
        kopf.info(body, reason="Profiled", message=message)
        logger.info("profiled: %s", message)
    else:
        reason, message = result
        await patch_profile_status(kube, svc, (("Profiled", "False", reason, message),))
        kopf.warn(body, reason="ProfileFailed", message=f"{reason}: {message}"[:_MAX_MESSAGE])
        logger.warning("profile failed: %s: %s", reason, message)
    await _call(
        kube, "PATCH", f"/apis/batch/v1/namespaces/{ns}/jobs/{name}",
        {"metadata": {"annotations": {RECORDED_ANNOTATION: "true"}}}, content_type="application/merge-patch+json",
    )  # fmt: skip


async def _failure_detail(kube: Kube, ns: str, job: dict[str, Any]) -> str:
    """The Job's Failed condition, plus the container's termination message (its log tail) when there is one."""
    failed: dict[str, Any] = next(
        (c for c in (job.get("status") or {}).get("conditions") or [] if c.get("type") == "Failed"), {}
    )
    detail = f"{failed.get('reason', 'Failed')}: {failed.get('message', '')}".strip()
    pods = await _call(
        kube,
        "GET",
        f"/api/v1/namespaces/{ns}/pods",
        query=[("labelSelector", f"job-name={job['metadata']['name']}")],
    )
    for pod in pods.get("items", []):
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
    current_hash = spec_profile_hash(svc.spec, _engine_image(svc, settings))
    capacity_hash = ((body.get("status") or {}).get("capacity") or {}).get("specHash")
    jobs = await list_profile_jobs(kube, svc)
    pods = (
        await _call(
            kube,
            "GET",
            f"/api/v1/namespaces/{svc.namespace}/pods",
            query=[("labelSelector", selector_string(svc))],
        )
    ).get("items", [])
    pod_ip = current_replica_ip(svc, settings, pods)
    plan = decide(svc, current_hash, capacity_hash, [_view(j) for j in jobs.values()], pod_ip is not None)

    for name in plan.delete:
        await _delete(kube, f"/apis/batch/v1/namespaces/{svc.namespace}/jobs/{name}")
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
    if plan.record is not None:
        await record_job(kube, body, svc, jobs[plan.record], logger)
    if plan.clear_annotation:
        await _call(
            kube, "PATCH", f"/apis/{API_VERSION}/namespaces/{svc.namespace}/{PLURAL}/{svc.name}",
            {"metadata": {"annotations": {REPROFILE_ANNOTATION: None}}}, content_type="application/merge-patch+json",
        )  # fmt: skip
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
