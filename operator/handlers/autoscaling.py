"""The built-in autoscaler loop: scrape each replica, decide, scale, explain.

What it is: one kopf daemon per LLMService with ``autoscaling.mode: builtin``.
Every ``autoscaling.intervalSeconds`` it lists the service's pods, scrapes each
ready pod's ``/metrics`` (plimsoll or vLLM names) with httpx under a short
timeout, hands the observations to the pure
:class:`plimsoll.operator.scaling.autoscaler.Autoscaler`, patches
``spec.replicas`` (the scale subresource's field) when the decision
changes the count (reconcile then resizes the Deployment), writes
``status.autoscaler`` and the ``ScalingLimited`` / ``SLOAtRisk`` conditions, and
posts an Event for every change of replicas or of the limit.

What it is not: the decision logic (``operator/scaling``), and not active for
``hpa``/``keda``/``off`` modes, where another owner writes replicas and the two
must never fight. Importing this module registers the daemon with kopf's
default registry.
"""

import asyncio
import logging
import time
from typing import Any

import httpx
import kopf
from opentelemetry import trace
from pydantic import ValidationError

from plimsoll.operator.api.base import API_VERSION, GROUP, KIND, PLURAL, VERSION
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers import scale_phases
from plimsoll.operator.handlers.attainment import AttainmentState, track_attainment
from plimsoll.operator.handlers.drift import DriftState, track_drift
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.scale_up import follow_timeline, open_timeline
from plimsoll.operator.handlers.spans import decision_attributes, llmservice_span
from plimsoll.operator.handlers.status_writer import update_status
from plimsoll.operator.resources.labels import selector_string
from plimsoll.operator.scaling.autoscaler import Autoscaler, AutoscalerConfig, PodObservation
from plimsoll.operator.scaling.autoscaler_loop import (
    LoopState,
    condition_states,
    same_decision,
    status_patch,
    warn_scaling_limited,
)
from plimsoll.operator.scaling.inputs import autoscaler_config
from plimsoll.operator.scaling.kv_cache import kv_cache_status
from plimsoll.operator.scaling.metrics import MetricsError, PodSample, parse_scrape
from plimsoll.operator.scaling.scale_to_zero import floored
from plimsoll.operator.scaling.sizing import NoTargetError
from plimsoll.operator.scaling.slo import check_slo

DEFAULT_PORT = 8000
SCRAPE_TIMEOUT_S = 2.0
# Percentiles over less than a minute of traffic are noise.
SLO_WINDOW_S = 60.0
# Unchanged replicas and conditions: refresh status.autoscaler at most this often.
STATUS_MIN_INTERVAL_S = 15.0


def pod_is_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True (what a Service's endpoints use)."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def counts_for_scaling(pod: dict[str, Any]) -> bool:
    """Pods being deleted or finished are ignored entirely, as the HPA ignores them."""
    phase = (pod.get("status") or {}).get("phase")
    return not pod["metadata"].get("deletionTimestamp") and phase not in ("Failed", "Succeeded")


def metrics_url(pod: dict[str, Any]) -> str | None:
    """``http://<podIP>:<port named http>/metrics``, or None before the pod has an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = DEFAULT_PORT
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == "http":
                port = int(p["containerPort"])
    return f"http://{ip}:{port}/metrics"


async def scrape(http: httpx.AsyncClient, url: str) -> PodSample | str:
    """One pod's parsed metrics, or the reason they could not be read."""
    try:
        response = await http.get(url, timeout=SCRAPE_TIMEOUT_S)
        response.raise_for_status()
        return parse_scrape(response.text)
    except (httpx.HTTPError, MetricsError) as error:
        return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


async def observe(http: httpx.AsyncClient, pods: list[dict[str, Any]]) -> list[PodObservation]:
    """Readiness and metrics of every pod that counts; unready pods are not scraped."""
    counted = [p for p in pods if counts_for_scaling(p)]

    async def one(pod: dict[str, Any]) -> PodObservation:
        name = pod["metadata"]["name"]
        url = metrics_url(pod)
        if not pod_is_ready(pod) or url is None:
            return PodObservation(name=name, ready=False, sample=None)
        result = await scrape(http, url)
        if isinstance(result, str):
            return PodObservation(name=name, ready=True, sample=None, error=result)
        return PodObservation(name=name, ready=True, sample=result)

    return list(await asyncio.gather(*(one(p) for p in counted)))


async def list_pods(kube: Kube, svc: LLMService) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = await kube.list_objects(
        "v1", "Pod", svc.namespace, label_selector=selector_string(svc)
    )
    return pods


async def set_replicas(kube: Kube, svc: LLMService, replicas: int) -> None:
    """Write ``spec.replicas`` (the field the scale subresource maps to); reconcile resizes the Deployment.

    A merge patch on the LLMService itself rather than on ``/scale``: same field,
    and the operator already holds ``patch`` on llmservices, so no extra RBAC.
    """
    await kube.merge_patch(API_VERSION, KIND, svc.namespace, svc.name, {"spec": {"replicas": replicas}})


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def autoscale_llmservice(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    """Scrape → decide → scale → explain, every ``autoscaling.intervalSeconds``, until the object goes."""
    state = LoopState()
    drift = DriftState()
    attainment = AttainmentState()
    async with httpx.AsyncClient() as http:
        while not stopped:
            interval = 5.0
            try:
                svc = LLMService.from_body(body)
                interval = float(svc.spec.autoscaling.interval_seconds)
                if svc.spec.autoscaling.mode != "builtin":
                    state.scaler = None
                else:
                    with llmservice_span("autoscale", svc.namespace, svc.name):
                        await _tick(memo.kube, body, svc, http, state, drift, attainment, logger)
            except ValidationError:
                pass  # reported by reconcile as InvalidSpec
            except Exception as error:  # one failed tick must not end the loop
                logger.warning("autoscaler tick failed: %s", error)
            await stopped.wait(interval)


def _idle_reason(status: dict[str, Any]) -> Any:
    return ((status.get("autoscaler") or {}).get("decision") or {}).get("reason")


async def _report_no_target(
    kube: Kube, svc: LLMService, status: dict[str, Any], error: NoTargetError,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:  # fmt: skip
    """Say once, in status, why nothing is being scaled yet (e.g. the profile is still running)."""
    idle = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "formula": "no per-replica target",
        # Merge patch: nulls remove what an earlier decision left behind.
        "inputs": None,
        "decision": {
            **dict.fromkeys(("currentReplicas", "desiredReplicas", "recommendation",
                             "stabilizedRecommendation", "fastPath", "scalingLimited", "limitedReason")),
            "reason": "NoTarget",
            "message": str(error),
        },
    }  # fmt: skip

    def change(current: dict[str, Any]) -> dict[str, Any] | None:
        return None if _idle_reason(current) == "NoTarget" else {"autoscaler": idle}

    if await update_status(kube, svc.namespace, svc.name, change, seen=status) is not None:
        logger.info("autoscaler idle: %s", error)


async def _tick(
    kube: Kube,
    body: kopf.Body,
    svc: LLMService,
    http: httpx.AsyncClient,
    state: LoopState,
    drift: DriftState,
    attainment: AttainmentState,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:
    status = dict(body.get("status") or {})
    profiled = (status.get("capacity") or {}).get("concurrencyPerReplica")
    try:
        # Zero is the idle rule's decision (scale_phases), never the HPA formula's.
        config: AutoscalerConfig = floored(autoscaler_config(svc.spec, profiled))
    except NoTargetError as error:
        state.scaler = None
        await _report_no_target(kube, svc, status, error, logger)
        return
    current = svc.spec.desired_replicas()
    scaler = state.scaler
    if scaler is None or state.needs_fresh_scaler(config, current):
        # A new target or bounds, or a count someone else wrote (the initial sizing from expectedLoad,
        # `kubectl scale`): start a fresh history seeded with the current count, as after a restart,
        # so recommendations made for the old count cannot undo the new one before a full window.
        scaler = state.scaler = Autoscaler(config)

    pods = await list_pods(kube, svc)
    observations = await observe(http, pods)
    # Wall time for readable status, never going backwards for the decision's windows.
    now = state.last_now = max(time.time(), state.last_now)
    # Zero replicas, a drain under way, or an idle service going to zero: scale_phases owns the tick.
    if await scale_phases.before_decide(kube, body, svc, http, config, current, pods, observations, now, logger):
        return
    decision = scaler.decide(now, current, observations)
    trace.get_current_span().set_attributes(decision_attributes(decision))
    state.saw(current, decision.desired_replicas)
    state.saw_metric(now, decision.metric, decision.target)

    samples = {o.name: o.sample for o in observations if o.sample is not None}
    try:
        await track_drift(kube, body, svc, drift, samples, now, logger)
        await follow_timeline(kube, body, svc, state, pods, samples, now, logger)
    except Exception as error:  # neither check may stop scaling
        logger.warning("profile drift or scale-up timeline failed: %s", error)
    base_urls = {p["metadata"]["name"]: url.removesuffix("/metrics") for p in pods if (url := metrics_url(p))}
    counted = sum(1 for p in pods if counts_for_scaling(p))
    try:
        good_1m = await track_attainment(http, svc, attainment, samples, base_urls, counted, now, logger)
    except Exception as error:
        good_1m = None
        logger.warning("SLO attainment failed: %s", error)
    slo = None
    if state.slo_base is None:
        state.slo_base = (now, samples)
    elif now - state.slo_base[0] >= SLO_WINDOW_S:
        check = check_slo(
            ttft_p95_ms=svc.spec.slo.ttft_p95_ms, tpot_p50_ms=svc.spec.slo.tpot_p50_ms,
            current=samples, previous=state.slo_base[1], attainment=good_1m,
        )  # fmt: skip
        slo = (check.status, check.reason, check.message)
        state.slo_base = (now, samples)

    if decision.changed and decision.desired_replicas < current:
        # Two-phase: drain the chosen pods first; scale_phases lowers the count once they are empty.
        await scale_phases.start_scale_down(kube, body, svc, http, decision, pods, observations, logger)
    elif decision.changed:
        await set_replicas(kube, svc, decision.desired_replicas)
        open_timeline(state, now, current, decision.desired_replicas, pods)
        kopf.info(body, reason="ScaledUp", message=decision.event_message())
        logger.info("ScaledUp: %s", decision.event_message())
    if warn_scaling_limited(decision, status.get("conditions")):
        kopf.warn(body, reason="ScalingLimited", message=decision.event_message())

    generation = svc.metadata.generation
    patch = status_patch(status, decision, generation, slo)
    # Write at once when replicas or a condition's status change; otherwise at most every
    # STATUS_MIN_INTERVAL_S, so a noisy load does not turn into a status write per tick.
    must = decision.changed or condition_states(patch["conditions"]) != condition_states(
        status.get("conditions")
    )
    may = not same_decision(status.get("autoscaler"), patch["autoscaler"]) and (
        now - state.last_write >= STATUS_MIN_INTERVAL_S
    )
    if must or may:
        # Written on the freshest copy: reconcile or the profiler may have set other conditions since.
        kv = kv_cache_status(samples)  # status.kvCache: hit rates per KV tier, with the same write

        def change(current: dict[str, Any]) -> dict[str, Any]:
            patch = status_patch(current, decision, generation, slo)
            return {**patch, "kvCache": kv} if kv is not None else patch

        await update_status(kube, svc.namespace, svc.name, change)
        state.last_write = now
