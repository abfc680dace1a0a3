"""The replica-planning loop: observe, plan, act, write status once — every tick, per LLMService.

What it is: one kopf daemon per LLMService. With ``autoscaling.mode: builtin``,
every ``autoscaling.intervalSeconds`` its :class:`ReplicaLoop`:

1. **observes**: lists the service's pods, scrapes each Ready (or marked) pod's
   ``/metrics``, asks the router's ``/hold`` when the service can be at zero,
   and measures SLO attainment (``attainment.py``);
2. **plans**: hands that, the spec and the status to its
   :class:`~plimsoll.operator.scaling.planner.ReplicaPlanner`, the one place
   replica counts are decided;
3. **acts**: writes each changed count (``replica_writer.py``, the only writer
   of ``spec.replicas``), keeps every pod the plan drains marked (label and
   deletion cost; ``POST /drain`` again whenever its ``/ready`` still answers
   200, as after a replica restart or someone's ``DELETE /drain``), unmarks
   the others (``DELETE /drain``), posts the plan's Events and feeds the
   operator's own metrics;
4. **writes status once**: the plan's fields and conditions and ``ProfileDrift``
   (``drift.py``) in one update through ``status_writer.py``.

:func:`size_new_service` is the planner's first rule on its own, for
reconcile to run before it builds the Deployment of a service without
``spec.replicas``; :func:`start_variant_deployments` likewise creates a new
hardware variant's Deployment with the planner's first count. With
``spec.variants`` a tick also reads each variant Deployment's count and what the
replicas cost (for ``status.cost``). The planner and the drift and attainment trackers live in
the daemon's frame, so they go when the LLMService goes (kopf stops its daemon).

What it is not: any decision (``operator/scaling/planner.py``), any HTTP call
to a pod (``pod_http.py``), or active in ``hpa``/``keda``/``off`` modes, where
another owner writes replicas and the two must never fight. Importing this
module registers the daemon with kopf's default registry.
"""

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import kopf
from kubernetes_asyncio.client.exceptions import ApiException
from opentelemetry import trace
from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from plimsoll.operator.api.base import GROUP, PLURAL, VERSION
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers import pod_http
from plimsoll.operator.handlers.attainment import (
    AttainmentState,
    cost_window,
    forget_attainment,
    track_attainment,
)
from plimsoll.operator.handlers.drift import DriftState, DriftUpdate, after_write
from plimsoll.operator.handlers.handler_types import Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.pods import (
    counts_for_scaling,
    is_marked_for_removal,
    is_parked,
    list_pods,
    list_prefill_pods,
    metrics_url,
    pod_is_ready,
    pod_url,
    unschedulable,
)
from plimsoll.operator.handlers.replica_client import ReplicaClient
from plimsoll.operator.handlers.replica_writer import create_variant_deployment, write_replicas
from plimsoll.operator.handlers.spans import llmservice_span
from plimsoll.operator.handlers.status_writer import StatusWrite, update_status, with_conditions
from plimsoll.operator.handlers.variant_drift import VariantDrift
from plimsoll.operator.resources.engine import ENGINE_CONTAINER
from plimsoll.operator.resources.labels import selector_labels
from plimsoll.operator.resources.variants import VARIANT_LABEL, variants_selector
from plimsoll.operator.scaling.observations import Observations, PodObservation, RouterDemand
from plimsoll.operator.scaling.planner import ReplicaPlanner, needs_router_demand
from plimsoll.operator.scaling.replica_plan import (
    DELETION_COST_ANNOTATION,
    DRAINING_DELETION_COST,
    DRAINING_LABEL,
    STANDBY_LABEL,
    Drain,
    Park,
    Plan,
    Wake,
)
from plimsoll.operator.scaling.scale_up_timeline import PHASES
from plimsoll.operator.scaling.shed_demand import attainment_misses
from plimsoll.operator.scaling.timestamps import parse_time
from plimsoll.operator.scaling.variant_state import billed_cost_per_hour, variant_pods

# (type, reason, message) -> an Event on the LLMService.
PostEvent = Callable[[str, str, str], None]

# In the default registry: `plimsoll operator --metrics-bind-address` (the chart's
# metrics.enabled) serves them beside the process collectors.
REQUESTS_CUT = Counter(
    "plimsoll_operator_requests_cut_by_scale_down",
    "Requests the replicas removed by a scale-down ended at shutdown (their own "
    "plimsoll_requests_cut_by_shutdown_total, last seen before they went).",
    ["namespace", "llmservice"],
)
SCALE_UP_PHASE_SECONDS = Histogram(
    "plimsoll_operator_scale_up_phase_seconds",
    "Seconds each phase of a built-in scale-up took, from the mark before it: " + ", ".join(PHASES[1:]) + ".",
    ["phase"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
)


def kopf_events(body: Mapping[str, Any]) -> PostEvent:
    """Events through kopf's poster (batched, retried), on ``body``."""

    def post(type_: str, reason: str, message: str) -> None:
        kopf.event(cast(kopf.Body, body), type=type_, reason=reason, message=message)

    return post


@dataclass
class ReplicaLoop:
    """One LLMService's loop state and its tick (see the module docstring)."""

    kube: Kube
    http: httpx.AsyncClient
    post: PostEvent
    logger: Log
    planner: ReplicaPlanner = field(default_factory=lambda: ReplicaPlanner(ENGINE_CONTAINER))
    drift: DriftState = field(default_factory=DriftState)
    variant_drift: VariantDrift = field(default_factory=VariantDrift)
    attainment: AttainmentState = field(default_factory=AttainmentState)

    async def tick(self, body: Mapping[str, Any], now: float | None = None) -> Plan | None:
        """One observe → plan → act → write pass; the plan (None when the built-in loop is not in charge)."""
        svc = LLMService.from_body(body)
        if svc.spec.autoscaling.mode != "builtin":
            self.planner.forget()
            return None
        status = dict(body.get("status") or {})
        with llmservice_span("autoscale", svc.namespace, svc.name):
            pods = await list_pods(self.kube, svc)
            prefill = await list_prefill_pods(self.kube, svc) if svc.spec.disaggregation is not None else []
            observations = await self.observe(svc, body, pods, prefill)
            plan = self.planner.plan(time.time() if now is None else now, observations, svc.spec, status)
            if plan.decision is not None:
                trace.get_current_span().set_attributes(plan.decision.span_attributes())
            if not await self.act(svc, body, plan, pods):
                return plan
            drift, drifted = None, None
            try:
                if svc.spec.variants:
                    drift, drifted = self.variant_drift.check(svc, status, observations, plan.time)
                else:
                    drift = self.drift.check(svc, status, observations.ready_samples(), plan.time)
            except Exception as error:  # the drift check may not stop scaling
                self.logger.warning("profile drift check failed: %s", error)
            written = await self.write_status(svc, plan, drift)
            if drift is not None and written is not None:
                before = written.condition_before("ProfileDrift")
                await after_write(self.kube, svc, drift, str((before or {}).get("status", "Unknown")), self.post,
                                  self.logger, variant=drifted)  # fmt: skip
        return plan

    async def observe(
        self, svc: LLMService, body: Mapping[str, Any], pods: list[dict[str, Any]],
        prefill: list[dict[str, Any]] | None = None,
    ) -> Observations:
        """Every counted pod (Ready ones scraped) and every marked one (scraped: a drain watches them);
        ``prefill``: a split service's prefill pool, observed alike."""
        client = await self.client(svc)
        seen = [p for p in await observe_pods(client, pods) if p is not None]
        prefill_seen = [p for p in await observe_pods(client, prefill or []) if p is not None]
        router = await self._router_demand(svc) if needs_router_demand(svc.spec) else None
        samples = {p.name: p.sample for p in seen if p.ready and not p.terminating and p.sample is not None}
        base_urls = {p["metadata"]["name"]: url for p in pods if (url := pod_url(p, ""))}
        counted = sum(1 for p in seen if not p.terminating)
        variant_replicas: dict[str, int] = {}
        cost_per_hour = None
        if svc.spec.variants:
            variant_replicas = await self._variant_replicas(svc)
            views = variant_pods(Observations(pods=tuple(seen)), [v.name for v in svc.spec.variants])
            cost_per_hour = billed_cost_per_hour(list(svc.spec.variants), views)
        try:
            shed = attainment_misses(router, samples) or None
            attainment = await track_attainment(
                client, svc, self.attainment, samples, base_urls, counted, time.time(), self.logger,
                cost_per_hour=cost_per_hour, shed=shed,
            )  # fmt: skip
        except Exception as error:  # SLO bookkeeping may not stop scaling
            attainment = None
            self.logger.warning("SLO attainment failed: %s", error)
        meta = body.get("metadata") or {}
        cost = None
        if cost_per_hour is not None:
            cost = cost_window(self.attainment, cost_per_hour)
        return Observations(
            pods=tuple(seen),
            pod_objects=tuple(pods),
            router=router,
            attainment=attainment,
            generation=svc.metadata.generation,
            created_at=parse_time(meta.get("creationTimestamp")),
            prefill_pods=tuple(prefill_seen),
            variant_replicas=variant_replicas,
            cost=cost,
        )

    async def _variant_replicas(self, svc: LLMService) -> dict[str, int]:
        """Each variant Deployment's spec.replicas (a variant without one yet is left out)."""
        wanted = {v.name for v in svc.spec.variants}
        found = await self.kube.list_objects(
            "apps/v1", "Deployment", svc.namespace, label_selector=variants_selector(svc)
        )
        counts: dict[str, int] = {}
        for deployment in found:
            name = (deployment["metadata"].get("labels") or {}).get(VARIANT_LABEL)
            if isinstance(name, str) and name in wanted and not deployment["metadata"].get("deletionTimestamp"):
                counts[name] = int((deployment.get("spec") or {}).get("replicas", 0) or 0)
        return counts

    async def _router_demand(self, svc: LLMService) -> RouterDemand | None:
        selector = ",".join(f"{k}={v}" for k, v in sorted(selector_labels(svc, "router").items()))
        routers = await self.kube.list_objects("v1", "Pod", svc.namespace, label_selector=selector)
        urls = [
            url
            for p in routers
            if not p["metadata"].get("deletionTimestamp") and (url := pod_url(p, "/hold"))
        ]
        return await pod_http.hold(await self.client(svc), urls)

    async def act(
        self, svc: LLMService, body: Mapping[str, Any], plan: Plan, pods: list[dict[str, Any]]
    ) -> bool:
        """Counts, pod marks, Events and metrics; False when a count could not be written as planned."""
        version = (body.get("metadata") or {}).get("resourceVersion")
        for count in plan.changes():
            try:
                precondition = version if count.only_if_unchanged else None
                await write_replicas(
                    self.kube, svc.namespace, svc.name, count.pool, count.desired, precondition
                )
            except ApiException as error:
                if error.status not in (404, 409):
                    raise
                # Someone wrote the object first (or deleted it): the next tick plans from the new copy.
                self.logger.info("replica count not written (%s): the LLMService changed since it was read",
                                 error.status)  # fmt: skip
                return False
        by_name = {p["metadata"]["name"]: p for p in pods}
        await asyncio.gather(*(self._keep(svc, by_name[a.pod], a) for a in plan.actions if a.pod in by_name))
        for event in plan.events:
            self.post(event.type, event.reason, event.message)
            self.logger.info("%s: %s", event.reason, event.message)
        if plan.requests_cut:
            REQUESTS_CUT.labels(svc.namespace, svc.name).inc(plan.requests_cut)
        for phase, seconds in plan.scale_up_phases.items():
            SCALE_UP_PHASE_SECONDS.labels(phase).observe(seconds)
        return True

    async def client(self, svc: LLMService) -> ReplicaClient:
        """Calls to ``svc``'s pods: byte-capped, with its admin key (read once from its Secret, then cached)."""
        return await ReplicaClient.for_service(self.kube, svc, self.http)

    async def _keep(self, svc: LLMService, pod: dict[str, Any], action: Any) -> None:
        """Make one pod marked (Drain) or unmarked (Undrain), as the plan says it should be now."""
        name = pod["metadata"]["name"]
        base = pod_url(pod, "")
        try:
            if isinstance(action, Park | Wake):
                await self._keep_standby(svc, pod, action, base)
            elif isinstance(action, Drain):
                annotations = pod["metadata"].get("annotations") or {}
                if (
                    not is_marked_for_removal(pod)
                    or annotations.get(DELETION_COST_ANNOTATION) != DRAINING_DELETION_COST
                ):
                    await self._mark(svc, name, on=True)
                if base is not None:
                    await keep_engine_mark(await self.client(svc), base, marked=True)
            elif base is None or await keep_engine_mark(await self.client(svc), base, marked=False):
                # The label goes once the replica has taken its own mark off (else: again next tick).
                await self._mark(svc, name, on=False)
        except ApiException as error:
            if error.status != 404:
                raise  # a pod already gone needs nothing

    async def _keep_standby(self, svc: LLMService, pod: dict[str, Any], action: Park | Wake, base: str | None) -> None:
        """Parked: the standby label (the router sends it nothing), lowest deletion cost, asleep once idle.
        Woken: awake first, unmarked, then the label off (the router sends it requests from then on)."""
        name = pod["metadata"]["name"]
        labels = pod["metadata"].get("labels") or {}
        client = await self.client(svc)
        if isinstance(action, Park):
            if labels.get(STANDBY_LABEL) != "true" or labels.get(DRAINING_LABEL) is not None:
                await self._label_standby(svc, name, on=True)
            if base is not None:
                # Asked every tick: an asleep replica answers at once, a loading or busy one says why not yet.
                why = await pod_http.sleep(client, base, action.level)
                if why is not None:
                    self.logger.debug("pod %s not asleep yet (again next tick): %s", name, why)
            return
        if base is None or not await pod_http.wake_up(client, base):
            return  # not awake yet: the plan wakes it again next tick
        await pod_http.unmark(client, base)
        await self._label_standby(svc, name, on=False)

    async def _label_standby(self, svc: LLMService, pod: str, on: bool) -> None:
        patch = {"metadata": {
            "labels": {STANDBY_LABEL: "true" if on else None, DRAINING_LABEL: None},
            "annotations": {DELETION_COST_ANNOTATION: DRAINING_DELETION_COST if on else None},
        }}  # fmt: skip
        await self.kube.merge_patch("v1", "Pod", svc.namespace, pod, patch)

    async def _mark(self, svc: LLMService, pod: str, on: bool) -> None:
        """The router label and the ReplicaSet deletion cost (on), or neither (off)."""
        patch = {"metadata": {
            "labels": {DRAINING_LABEL: "true" if on else None},
            "annotations": {DELETION_COST_ANNOTATION: DRAINING_DELETION_COST if on else None},
        }}  # fmt: skip
        await self.kube.merge_patch("v1", "Pod", svc.namespace, pod, patch)

    async def write_status(
        self, svc: LLMService, plan: Plan, drift: DriftUpdate | None
    ) -> StatusWrite | None:
        """The tick's one status write: the plan's fields and conditions, and ProfileDrift."""
        fields = dict(plan.status.fields) if plan.status is not None else {}
        updates = list(plan.status.conditions) if plan.status is not None else []
        if drift is not None:
            updates.append(drift.condition())
        if not fields and not updates:
            return None
        generation = svc.metadata.generation

        def change(current: dict[str, Any]) -> dict[str, Any]:
            if not updates:
                return fields
            return {**fields, "conditions": with_conditions(current.get("conditions"), updates, generation)}

        return await update_status(self.kube, svc.namespace, svc.name, change)


async def keep_engine_mark(http: ReplicaClient, base_url: str, marked: bool) -> bool:
    """The replica's own removal mark as the plan wants it; False when an unmark went unanswered.

    Marked: ``POST /drain`` whenever ``/ready`` still answers 200 — asked every tick, so a
    restarted replica, or a ``DELETE /drain`` by hand, is marked again. Unmarked: ``DELETE /drain``.
    """
    if not marked:
        return await pod_http.unmark(http, base_url)
    if await pod_http.answers_ready(http, base_url):
        await pod_http.mark_for_removal(http, base_url)
    return True


async def observe_pods(http: ReplicaClient, pods: list[dict[str, Any]]) -> list[PodObservation | None]:
    """One observation per pod that counts for scaling or carries the removal mark (None for the rest)."""

    async def one(pod: dict[str, Any]) -> PodObservation | None:
        counted, marked, parked = counts_for_scaling(pod), is_marked_for_removal(pod), is_parked(pod)
        if not counted and not marked:
            return None
        name, ready = pod["metadata"]["name"], pod_is_ready(pod)
        created = parse_time(pod["metadata"].get("creationTimestamp"))
        url = metrics_url(pod)
        seen: dict[str, Any] = dict(
            draining=marked, terminating=not counted, standby=parked, created_at=created,
            variant=(pod["metadata"].get("labels") or {}).get(VARIANT_LABEL), unschedulable=unschedulable(pod),
        )  # fmt: skip
        # Parked pods are scraped too (asleep they are not Ready): whether they sleep, what they hold.
        if url is None or not ((ready and counted) or marked or (parked and counted)):
            return PodObservation(name, ready, None, **seen)
        result = await pod_http.scrape(http, url)
        sample, error = (None, result) if isinstance(result, str) else (result, None)
        return PodObservation(name, ready, sample, error, **seen)

    return list(await asyncio.gather(*(one(p) for p in pods)))


async def size_new_service(
    kube: Kube, body: Mapping[str, Any], svc: LLMService, post: PostEvent, logger: Log
) -> LLMService:
    """The starting size of a service without ``spec.replicas``: written, recorded, and returned for the Deployment."""
    status = dict(body.get("status") or {})
    plan = ReplicaPlanner.plan_start(time.time(), svc.spec, status)
    if plan is None:
        return svc
    meta = body.get("metadata") or {}
    count = plan.count()
    if count is not None:
        try:
            await write_replicas(
                kube, svc.namespace, svc.name, count.pool, count.desired, meta.get("resourceVersion")
            )
        except ApiException as error:
            if error.status != 409:
                raise
            # Someone (an autoscaler, the user) wrote the object first; the next reconcile re-reads it.
            logger.info("initial sizing skipped: the LLMService changed since it was read")
            return svc
    if plan.status is not None:
        fields = dict(plan.status.fields)

        def change(current: dict[str, Any]) -> dict[str, Any] | None:
            stored, fresh = current.get("sizing") or {}, fields.get("sizing") or {}
            same = all(stored.get(k) == v for k, v in fresh.items() if k != "time")
            return None if same else fields

        if await update_status(kube, svc.namespace, svc.name, change, seen=status) is not None:
            for event in plan.events:
                post(event.type, event.reason, event.message)
                logger.info("%s: %s", event.reason, event.message)
    if count is None:
        return svc
    return svc.model_copy(update={"spec": svc.spec.model_copy(update={"replicas": count.desired})})


async def start_variant_deployments(
    kube: Kube, body: Mapping[str, Any], svc: LLMService, missing: list[dict[str, Any]], logger: Log
) -> None:
    """Create the variant Deployments reconcile found missing, each with the planner's first count."""
    if not missing:
        return
    counts = ReplicaPlanner.variant_start_counts(svc.spec, dict(body.get("status") or {}))
    for deployment in missing:
        variant = deployment["spec"]["template"]["metadata"]["labels"][VARIANT_LABEL]
        kopf.adopt(deployment, owner=cast(kopf.Body, body))
        try:
            await create_variant_deployment(kube, deployment, counts[variant])
        except ApiException as error:
            if error.status != 409:
                raise
            continue  # created meanwhile (a second reconcile): its count is already someone's
        logger.info("created Deployment %s with %d replicas", deployment["metadata"]["name"], counts[variant])


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def plan_replicas(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    """Observe → plan → act → write, every ``autoscaling.intervalSeconds``, until the object goes."""
    try:
        async with httpx.AsyncClient() as http:
            loop = ReplicaLoop(memo.kube, http, kopf_events(body), logger)
            while not stopped:
                interval = 5.0
                try:
                    interval = float(LLMService.from_body(body).spec.autoscaling.interval_seconds)
                    await loop.tick(body)
                except ValidationError:
                    pass  # reported by reconcile as InvalidSpec
                except Exception as error:  # one failed tick must not end the loop
                    logger.warning("replica planning tick failed: %s", error)
                await stopped.wait(interval)
    finally:
        # The loop's state goes with this frame; the service's own series go with it.
        meta = body.get("metadata") or {}
        forget_series(str(meta.get("namespace", "")), str(meta.get("name", "")))


def forget_series(namespace: str, name: str) -> None:
    """Drop one LLMService's series from the operator's metrics (it was deleted, or the operator stops)."""
    with contextlib.suppress(KeyError):
        REQUESTS_CUT.remove(namespace, name)
    forget_attainment(namespace, name)
