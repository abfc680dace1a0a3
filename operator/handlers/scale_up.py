"""Following each built-in scale-up to the new pod's first answer: status, an Event and a histogram.

What it is: :func:`open_timeline` (called where the loop writes a larger
``spec.replicas``) and :func:`follow_timeline` (every tick after). When the
timeline is complete — or :data:`GIVE_UP_S` after the decision, whatever it
reached — it writes ``status.autoscaler.lastScaleUp`` through
``status_writer.py``, posts a Normal Event ``ScaleUpTimeline`` that reads as a
sentence, and observes each phase's seconds in
``plimsoll_operator_scale_up_phase_seconds{phase}`` (the default registry, served
by ``plimsoll operator --metrics-bind-address``).

What it is not: the marks themselves (``operator/scaling/scale_up_timeline.py``).
A second scale-up while one is followed replaces it: the newer one is the
one a reader asks about. Scale-ups from zero (``scale_phases``) are not followed.
"""

import logging
from typing import Any

import kopf
from prometheus_client import Histogram

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.status_writer import update_status
from plimsoll.operator.resources.engine import ENGINE_CONTAINER
from plimsoll.operator.scaling.autoscaler_loop import LoopState
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.scale_up_timeline import PHASES, ScaleUpTimeline

Log = logging.Logger | logging.LoggerAdapter[Any]
# A pod that has not answered after this long is written as it stands (complete: false).
GIVE_UP_S = 900.0

SCALE_UP_PHASE_SECONDS = Histogram(
    "plimsoll_operator_scale_up_phase_seconds",
    "Seconds each phase of a built-in scale-up took, from the mark before it: " + ", ".join(PHASES[1:]) + ".",
    ["phase"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
)


def open_timeline(
    state: LoopState, now: float, current: int, desired: int, pods: list[dict[str, Any]]
) -> None:
    state.timeline = ScaleUpTimeline(
        crossed_at=state.crossed_at if state.crossed_at is not None else now,
        decided_at=now, from_replicas=current, to_replicas=desired,
        existing_pods=frozenset(p["metadata"]["name"] for p in pods), container=ENGINE_CONTAINER,
    )  # fmt: skip


async def follow_timeline(
    kube: Kube,
    body: kopf.Body,
    svc: LLMService,
    state: LoopState,
    pods: list[dict[str, Any]],
    samples: dict[str, PodSample],
    now: float,
    logger: Log,
) -> ScaleUpTimeline | None:
    """Advance the open timeline; the timeline when it was just written, else None."""
    timeline = state.timeline
    if timeline is None:
        return None
    timeline.observe(now, pods, samples)
    if not timeline.complete and now - timeline.decided_at < GIVE_UP_S:
        return None
    state.timeline = None
    for phase, seconds in timeline.phase_seconds().items():
        if phase != "metricCrossedTarget":
            SCALE_UP_PHASE_SECONDS.labels(phase).observe(seconds)
    record = timeline.to_status()
    await update_status(kube, svc.namespace, svc.name, lambda _: {"autoscaler": {"lastScaleUp": record}})
    sentence = timeline.sentence()
    kopf.info(body, reason="ScaleUpTimeline", message=sentence)
    logger.info("ScaleUpTimeline: %s", sentence)
    return timeline
