"""Live SLO attainment and cost per LLMService, on the operator's metrics endpoint.

What it is: :func:`track_attainment`, called every replica-planning tick.
It tells each ready plimsoll replica the service's ``spec.slo`` when the
bounds the replica exports differ (``PUT /slo`` with the admin key: a new or restarted replica,
or a changed SLO), feeds the replicas' judged-request counters to an
:class:`AttainmentTracker`, and sets, in the default registry served by
``plimsoll operator --metrics-bind-address``:

- ``plimsoll_operator_slo_attainment_ratio{namespace,llmservice,window="1m"|"1h"}``
- ``plimsoll_operator_replica_seconds_per_1k_good_requests{namespace,llmservice}`` (1 h)
- with ``spec.variants`` (prices per replica): ``plimsoll_operator_cost_per_hour`` and
  ``plimsoll_operator_cost_per_1k_good_requests`` (1 h), with the same labels

It returns the 1-minute attainment, which ``SLOAtRisk`` reads.

What it is not: the arithmetic (``operator/scaling/attainment.py``). A service
without an SLO, or whose replicas do not judge requests, has no series.
"""

import contextlib
from dataclasses import dataclass

import httpx
from prometheus_client import Gauge

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.handler_types import Log
from plimsoll.operator.handlers.pod_http import put_slo
from plimsoll.operator.handlers.replica_client import ReplicaClient
from plimsoll.operator.scaling.attainment import (
    COST_WINDOW,
    WINDOWS_S,
    AttainmentTracker,
    needs_objectives,
    objectives_seconds,
)
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import CostWindow

SLO_ATTAINMENT = Gauge(
    "plimsoll_operator_slo_attainment_ratio",
    "Fraction of the requests the replicas finished in the window that met every spec.slo bound "
    "(each applied per request, as bench does).",
    ["namespace", "llmservice", "window"],
)
COST_PER_1K_GOOD = Gauge(
    "plimsoll_operator_replica_seconds_per_1k_good_requests",
    "Replica-seconds spent (ready or starting) per 1000 requests that met the SLO, over the last hour.",
    ["namespace", "llmservice"],
)
COST_PER_HOUR = Gauge(
    "plimsoll_operator_cost_per_hour",
    "What the replicas holding a node cost per hour now (spec.variants[].costPerHour).",
    ["namespace", "llmservice"],
)
MONEY_PER_1K_GOOD = Gauge(
    "plimsoll_operator_cost_per_1k_good_requests",
    "Cost spent per 1000 requests that met the SLO, over the last hour (spec.variants[].costPerHour).",
    ["namespace", "llmservice"],
)


@dataclass
class AttainmentState:
    tracker: AttainmentTracker | None = None


def forget_attainment(namespace: str, name: str) -> None:
    """Drop one service's attainment and cost series."""
    for window in WINDOWS_S:
        with contextlib.suppress(KeyError):
            SLO_ATTAINMENT.remove(namespace, name, window)
    for gauge in (COST_PER_1K_GOOD, COST_PER_HOUR, MONEY_PER_1K_GOOD):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)


async def track_attainment(
    http: ReplicaClient,
    svc: LLMService,
    state: AttainmentState,
    samples: dict[str, PodSample],
    base_urls: dict[str, str],
    replicas: int,
    now: float,
    logger: Log,
    cost_per_hour: float | None = None,
    shed: dict[str, float] | None = None,
) -> float | None:
    """One tick (see the module docstring); the 1-minute attainment, or None when there is none."""
    slo = svc.spec.slo
    wanted = objectives_seconds(slo.ttft_p95_ms, slo.tpot_p50_ms, slo.e2e_p95_ms)
    if not wanted:
        state.tracker = None
        forget_attainment(svc.namespace, svc.name)
        if cost_per_hour is not None:
            COST_PER_HOUR.labels(svc.namespace, svc.name).set(cost_per_hour)
        return None
    body = {"ttftP95Ms": slo.ttft_p95_ms, "tpotP50Ms": slo.tpot_p50_ms, "e2eP95Ms": slo.e2e_p95_ms}
    for name, sample in samples.items():
        if needs_objectives(sample, wanted) and name in base_urls:
            try:
                await put_slo(http, base_urls[name], body)
            except httpx.HTTPError as error:
                logger.info("could not set the SLO on pod %s (its requests are not judged): %s", name, error)
    if state.tracker is None or state.tracker.objectives != wanted:
        state.tracker = AttainmentTracker(objectives=wanted)
        forget_attainment(svc.namespace, svc.name)
    tracker = state.tracker
    tracker.observe(now, samples, replicas, cost_per_hour=cost_per_hour, shed=shed)
    for window, seconds in WINDOWS_S.items():
        ratio = tracker.attainment(seconds)
        if ratio is not None:
            SLO_ATTAINMENT.labels(svc.namespace, svc.name, window).set(ratio)
    cost = tracker.replica_seconds_per_1k_good(WINDOWS_S[COST_WINDOW])
    if cost is not None:
        COST_PER_1K_GOOD.labels(svc.namespace, svc.name).set(cost)
    if cost_per_hour is not None:
        COST_PER_HOUR.labels(svc.namespace, svc.name).set(cost_per_hour)
        spending = cost_window(state, cost_per_hour)
        if spending.spent is not None and spending.good_requests:
            MONEY_PER_1K_GOOD.labels(svc.namespace, svc.name).set(
                spending.spent / (spending.good_requests / 1000)
            )
    return tracker.attainment(WINDOWS_S["1m"])


def cost_window(state: AttainmentState, cost_per_hour: float) -> CostWindow:
    """What the replicas cost now and over the cost window, and the good requests in it."""
    tracker = state.tracker
    if tracker is None:
        return CostWindow(cost_per_hour, None, None, None)
    spent = tracker.spent(WINDOWS_S[COST_WINDOW])
    counted = tracker.counted(WINDOWS_S[COST_WINDOW])
    return CostWindow(
        cost_per_hour,
        None if spent is None else spent[0],
        None if counted is None else counted[0],
        None if spent is None else spent[1],
    )
