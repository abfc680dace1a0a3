"""Scale to zero, back from zero, and the two-phase scale-down: the autoscaler loop's I/O for them.

What it is: the hooks the built-in autoscaler's tick calls. :func:`before_decide`
runs first on every tick and takes the tick over when this module owns it: at
zero replicas (poll the router's ``GET /hold``; a held request brings
``max(1, min)`` replicas back within this tick), while a drain is in progress
(scrape the pods being drained; lower the count once they hold nothing or
``scaling.drainSeconds`` passed; call it off if the load came back), and when
``scaling.min: 0`` and nothing was seen for ``scaling.idleSeconds`` (drain the
last replicas, then 0). :func:`start_scale_down` is phase one of every
scale-down the autoscaler decides: mark the chosen pods (label
``plimsoll.dev/draining`` for the router, ``POST /drain`` so their readiness
drops, a low ``controller.kubernetes.io/pod-deletion-cost`` so the ReplicaSet
controller removes exactly them). It also measures cold starts
(``status.coldStart``, which the router reads) and keeps the count of requests
the removed replicas' shutdown cut (``status.scaleDown.requestsCutTotal`` and the
counter ``plimsoll_operator_requests_cut_by_scale_down_total``).

What it is not: the decisions themselves (``operator/scaling/scale_to_zero.py``,
``drain.py``, ``cold_start.py``) or the HPA formula (``autoscaler.py``).
"""

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import kopf
from prometheus_client import Counter

from plimsoll.bounded_http import SMALL_LIMIT_BYTES
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import ConditionUpdate
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.replica_client import ReplicaClient
from plimsoll.operator.handlers.status_writer import update_status, with_conditions
from plimsoll.operator.resources.labels import selector_labels
from plimsoll.operator.resources.settings import ENGINE_PORT
from plimsoll.operator.scaling.autoscaler import AutoscalerConfig, Decision, PodObservation
from plimsoll.operator.scaling.cold_start import ColdStartClock
from plimsoll.operator.scaling.drain import (
    DELETION_COST_ANNOTATION,
    DRAINING_DELETION_COST,
    DRAINING_LABEL,
    CutTally,
    DrainPlan,
    PodLoad,
    choose_victims,
    cut_by_shutdown,
    overloaded,
)
from plimsoll.operator.scaling.metrics import MetricsError, parse_scrape
from plimsoll.operator.scaling.scale_to_zero import IdleClock, wake_replicas

Logger = logging.Logger | logging.LoggerAdapter[Any]
TIMEOUT_S = 2.0

# In the default registry: `plimsoll operator --metrics-bind-address` (the chart's
# metrics.enabled) serves it beside the process collectors.
REQUESTS_CUT = Counter(
    "plimsoll_operator_requests_cut_by_scale_down",
    "Requests the replicas removed by a scale-down ended at shutdown (their own "
    "plimsoll_requests_cut_by_shutdown_total, last seen before they went).",
    ["namespace", "llmservice"],
)


@dataclass
class PhaseState:
    """What this module carries from tick to tick for one LLMService."""

    idle: IdleClock
    cold: ColdStartClock
    tally: CutTally
    plan: DrainPlan | None = None
    cut_total: float = 0.0
    zero_reported: bool = False
    last_status: dict[str, Any] = field(default_factory=dict)


_STATES: dict[str, PhaseState] = {}


def _parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _state(body: kopf.Body, svc: LLMService, now: float, pods_ready: int) -> PhaseState:
    key = f"{svc.namespace}/{svc.name}/{body['metadata'].get('uid')}"
    state = _STATES.get(key)
    if state is None:
        status = dict(body.get("status") or {})
        cold = ColdStartClock.from_status(status.get("coldStart"))
        created = _parse_time(body["metadata"].get("creationTimestamp"))
        if not cold.samples and pods_ready == 0 and created is not None and svc.spec.desired_replicas() > 0:
            # The very first start is a cold start too: measured from the object's creation.
            cold.needed(created)
        cut_total = float((status.get("scaleDown") or {}).get("requestsCutTotal") or 0.0)
        state = _STATES[key] = PhaseState(IdleClock(now), cold, CutTally(cut_total), cut_total=cut_total)
    return state


def _ip_url(pod: dict[str, Any], path: str) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{ENGINE_PORT}{path}" if ip else None


async def router_demand(kube: Kube, svc: LLMService, http: ReplicaClient) -> dict[str, Any] | None:
    """The router's ``GET /hold`` (held requests, oldest wait); None without a reachable router pod."""
    if not svc.spec.router_in_front():
        return None
    selector = ",".join(f"{k}={v}" for k, v in sorted(selector_labels(svc, "router").items()))
    for pod in await kube.list_objects("v1", "Pod", svc.namespace, label_selector=selector):
        url = None if pod["metadata"].get("deletionTimestamp") else _ip_url(pod, "/hold")
        if url is None:
            continue
        try:
            demand: dict[str, Any] = await http.get_json(url, limit=SMALL_LIMIT_BYTES, timeout=TIMEOUT_S)
            return demand
        except (httpx.HTTPError, ValueError):
            continue
    return None


async def _scrape_text(http: ReplicaClient, pod: dict[str, Any]) -> str | None:
    url = _ip_url(pod, "/metrics")
    if url is None:
        return None
    try:
        text: str = await http.get_text(url, timeout=TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return text


async def _victim_loads(http: ReplicaClient, pods: dict[str, dict[str, Any]], names: tuple[str, ...],
                        state: PhaseState) -> dict[str, float | None]:  # fmt: skip
    """In flight on each listed victim (scraped whether Ready or not); feeds the cut tally too."""

    async def one(name: str) -> tuple[str, float | None]:
        text = await _scrape_text(http, pods[name])
        if text is None:
            # Not answering: if it is not Ready nothing is routed to it either; count it as empty.
            return name, 0.0 if not _ready(pods[name]) else None
        state.tally.observe(name, cut_by_shutdown(text))
        try:
            return name, parse_scrape(text).in_flight
        except MetricsError:
            return name, None

    return dict(await asyncio.gather(*(one(n) for n in names if n in pods)))


def _ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])  # fmt: skip


async def _mark(kube: Kube, http: ReplicaClient, svc: LLMService, pod: dict[str, Any], on: bool) -> None:
    """Mark (or unmark) one pod for removal: router label, deletion cost, and the replica's own /drain."""
    patch = {"metadata": {
        "labels": {DRAINING_LABEL: "true" if on else None},
        "annotations": {DELETION_COST_ANNOTATION: DRAINING_DELETION_COST if on else None},
    }}  # fmt: skip
    await kube.merge_patch("v1", "Pod", svc.namespace, pod["metadata"]["name"], patch)
    url = _ip_url(pod, "/drain")
    if url is not None:
        # vLLM has no /drain (404): the label still keeps the router away, readiness stays up.
        with contextlib.suppress(httpx.HTTPError):
            await (http.post(url, timeout=TIMEOUT_S) if on else http.delete(url, timeout=TIMEOUT_S))


async def _patch_status(
    kube: Kube, svc: LLMService, state: PhaseState, condition: ConditionUpdate | None = None
) -> None:
    """Write coldStart and scaleDown (and one condition) through the one status writer."""
    fields: dict[str, Any] = {
        "coldStart": state.cold.to_status(),
        "scaleDown": {
            **(state.plan.to_status() if state.plan is not None else {"phase": "Idle", "pods": None}),
            **(state.last_status or {}),
            "requestsCutTotal": state.cut_total,
        },
    }

    def change(status: dict[str, Any]) -> dict[str, Any]:
        if condition is None:
            return fields
        conditions = with_conditions(status.get("conditions"), (condition,), svc.metadata.generation)
        return {**fields, "conditions": conditions}

    await update_status(kube, svc.namespace, svc.name, change)


async def start_scale_down(
    kube: Kube, body: kopf.Body, svc: LLMService, http: ReplicaClient, decision: Decision,
    pods: list[dict[str, Any]], observations: list[PodObservation], logger: Logger,
) -> None:  # fmt: skip
    """Phase one of a scale-down the autoscaler decided: choose, mark, and start waiting."""
    now = decision.time
    by_name = {p["metadata"]["name"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}
    loads = [PodLoad(o.name, o.ready, o.sample.in_flight if o.sample else (0.0 if not o.ready else None))
             for o in observations if o.name in by_name]  # fmt: skip
    count = decision.current_replicas - decision.desired_replicas
    victims = choose_victims(loads, count)
    state = _state(body, svc, now, sum(o.ready for o in observations))
    drain_s = float(svc.spec.scaling.drain_seconds if svc.spec.scaling else 120)
    await _begin(kube, body, svc, http, state, by_name, victims, decision.current_replicas,
                 decision.desired_replicas, now, drain_s, "ScaleDown", decision.event_message(), logger)  # fmt: skip


async def _begin(
    kube: Kube, body: kopf.Body, svc: LLMService, http: ReplicaClient, state: PhaseState,
    by_name: dict[str, dict[str, Any]], victims: tuple[str, ...], current: int, target: int, now: float,
    drain_s: float, purpose: str, why: str, logger: Logger,
) -> None:  # fmt: skip
    for name in victims:
        await _mark(kube, http, svc, by_name[name], on=True)
    state.plan = DrainPlan(victims, current, target, now, drain_s, purpose)
    state.last_status = {
        "reason": "Draining",
        "message": f"{why}; draining {', '.join(victims) or 'nothing'} first",
    }
    message = (f"{current} → {target}: draining {', '.join(victims)} (no new requests; up to "
               f"{drain_s:g} s for in-flight ones) before lowering the count; {why}")  # fmt: skip
    kopf.info(body, reason="DrainStarted", message=message)
    logger.info("DrainStarted: %s", message)
    await _patch_status(kube, svc, state)


async def before_decide(
    kube: Kube, body: kopf.Body, svc: LLMService, http: ReplicaClient, config: AutoscalerConfig,
    current: int, pods: list[dict[str, Any]], observations: list[PodObservation], now: float, logger: Logger,
) -> bool:  # fmt: skip
    """Handle this tick here (True: the autoscaler's decide is skipped) or leave it to the autoscaler."""
    from plimsoll.operator.handlers.autoscaling import set_replicas  # the loop's one writer of spec.replicas

    ready = sum(o.ready for o in observations)
    state = _state(body, svc, now, ready)
    by_name = {p["metadata"]["name"]: p for p in pods}
    dirty = False

    if state.cold.seen_ready(now, ready):
        logger.info("cold start measured: %s", state.cold.last)
        dirty = True
    # Removed pods' own count of requests their shutdown cut, last seen before they went.
    for name in state.tally.watched:
        if name in by_name:
            text = await _scrape_text(http, by_name[name])
            if text is not None:
                state.tally.observe(name, cut_by_shutdown(text))
    added = state.tally.settle(by_name)
    if added:
        REQUESTS_CUT.labels(svc.namespace, svc.name).inc(added)
        kopf.warn(
            body, reason="RequestsCut", message=f"{added:g} request(s) were cut by a scale-down's shutdown"
        )
    if state.tally.total != state.cut_total:
        state.cut_total = state.tally.total
        dirty = True

    scaling = svc.spec.scaling
    to_zero = scaling is not None and scaling.min == 0
    demand = await router_demand(kube, svc, http) if to_zero or current == 0 else None
    held = int((demand or {}).get("held") or 0)

    if current == 0:
        if not to_zero:
            if dirty:
                await _patch_status(kube, svc, state)
            return False  # someone scaled it to zero by hand: the autoscaler says ScalingDisabled
        if held > 0:
            wake = wake_replicas(config.min_replicas)
            await set_replicas(kube, svc, wake)
            state.cold.needed(now, (demand or {}).get("oldestHeldSeconds"))
            state.idle.last_activity = now
            state.zero_reported = False
            message = (f"0 → {wake}: {held} request(s) held by the router (oldest "
                       f"{(demand or {}).get('oldestHeldSeconds')} s); it releases them once a replica is Ready")  # fmt: skip
            kopf.info(body, reason="ScaledFromZero", message=message)
            logger.info("ScaledFromZero: %s", message)
            await _patch_status(kube, svc, state)
            return True
        if not state.zero_reported:
            condition: ConditionUpdate = (
                "ScalingLimited", "False", "ScaledToZero",
                f"scaled to zero after {scaling.idle_seconds} s without requests; the router holds the next "
                "request and a replica starts for it",
            )  # fmt: skip
            await _patch_status(kube, svc, state, condition)
            state.zero_reported = True
        elif dirty:
            await _patch_status(kube, svc, state)
        return True

    samples = {o.name: o.sample for o in observations if o.sample is not None}
    state.idle.observe(now, samples, held)
    if ready == 0:
        state.idle.last_activity = now  # a service still starting is not idle: nobody could have used it

    plan = state.plan
    if plan is not None:
        loads = await _victim_loads(http, by_name, plan.pods, state)
        kept = [s.in_flight for n, s in samples.items() if n not in plan.pods]
        came_back = (plan.purpose == "ScaleToZero" and held > 0) or (
            plan.purpose == "ScaleDown" and overloaded(kept, config.target_per_replica, config.tolerance)
        )
        if came_back:
            for name in plan.pods:
                if name in by_name:
                    await _mark(kube, http, svc, by_name[name], on=False)
            reason = f"{held} request(s) arrived" if plan.purpose == "ScaleToZero" else (
                f"the replicas that stay hold more than {config.target_per_replica:g} each")  # fmt: skip
            message = f"drain of {', '.join(plan.pods)} called off: {reason}; staying at {current}"
            kopf.info(body, reason="DrainCancelled", message=message)
            state.plan, state.last_status = None, {"reason": "DrainCancelled", "message": message}
            state.idle.last_activity = now
            await _patch_status(kube, svc, state)
            return True
        step = plan.step(now, loads)
        if not step.done:
            if dirty:
                await _patch_status(kube, svc, state)
            return True
        await set_replicas(kube, svc, plan.to_replicas)
        for name in plan.pods:
            state.tally.watch(name)
        reason = "ScaledToZero" if plan.to_replicas == 0 else "ScaledDown"
        message = f"{plan.from_replicas} → {plan.to_replicas}: {step.message}; removing exactly those pods"
        kopf.info(body, reason=reason, message=message) if step.reason == "Drained" else kopf.warn(
            body, reason=reason, message=message)  # fmt: skip
        logger.info("%s: %s", reason, message)
        state.last_status = {"reason": step.reason, "message": message, "lastPods": list(plan.pods)}
        state.plan = None
        await _patch_status(kube, svc, state)
        return True

    if to_zero and state.idle.should_scale_to_zero(now, scaling.idle_seconds):
        live = tuple(sorted(n for n, p in by_name.items() if not p["metadata"].get("deletionTimestamp")))
        why = f"no request seen for {state.idle.idle_for(now):.0f} s (scaling.idleSeconds {scaling.idle_seconds})"
        await _begin(kube, body, svc, http, state, by_name, live, current, 0, now,
                     float(scaling.drain_seconds), "ScaleToZero", why, logger)  # fmt: skip
        return True
    if dirty:
        await _patch_status(kube, svc, state)
    return False
