"""Live SLO attainment and cost per LLMService, on the operator's metrics endpoint.

What it is: :func:`track_attainment`, called every replica-planning tick.
It tells each ready plimsoll replica the service's ``spec.slo`` when the
bounds the replica exports differ (``PUT /slo`` with the admin key: a new or restarted replica,
or a changed SLO), feeds the replicas' judged-request counters to an
:class:`AttainmentTracker`, and sets, in the default registry served by
``plimsoll operator --metrics-bind-address``:

- ``plimsoll_operator_slo_attainment_ratio{namespace,llmservice,window="1m"|"1h"}``
- ``plimsoll_operator_replica_seconds_per_1k_good_requests{namespace,llmservice}`` (1 h)

It returns the 1-minute attainment, which ``SLOAtRisk`` reads.

What it is not: the arithmetic (``operator/scaling/attainment.py``). A service
without an SLO, or whose replicas do not judge requests, has no series.
"""

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import Gauge

from plimsoll.operator.api.llmservice import LLMService
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

Log = logging.Logger | logging.LoggerAdapter[Any]

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


@dataclass
class AttainmentState:
    tracker: AttainmentTracker | None = None


def forget_attainment(namespace: str, name: str) -> None:
    """Drop one service's attainment and cost series."""
    for window in WINDOWS_S:
        with contextlib.suppress(KeyError):
            SLO_ATTAINMENT.remove(namespace, name, window)
    with contextlib.suppress(KeyError):
        COST_PER_1K_GOOD.remove(namespace, name)


async def track_attainment(
    http: ReplicaClient,
    svc: LLMService,
    state: AttainmentState,
    samples: dict[str, PodSample],
    base_urls: dict[str, str],
    replicas: int,
    now: float,
    logger: Log,
) -> float | None:
    """One tick (see the module docstring); the 1-minute attainment, or None when there is none."""
    slo = svc.spec.slo
    wanted = objectives_seconds(slo.ttft_p95_ms, slo.tpot_p50_ms, slo.e2e_p95_ms)
    if not wanted:
        state.tracker = None
        forget_attainment(svc.namespace, svc.name)
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
    tracker.observe(now, samples, replicas)
    for window, seconds in WINDOWS_S.items():
        ratio = tracker.attainment(seconds)
        if ratio is not None:
            SLO_ATTAINMENT.labels(svc.namespace, svc.name, window).set(ratio)
    cost = tracker.replica_seconds_per_1k_good(WINDOWS_S[COST_WINDOW])
    if cost is not None:
        COST_PER_1K_GOOD.labels(svc.namespace, svc.name).set(cost)
    return tracker.attainment(WINDOWS_S["1m"])
