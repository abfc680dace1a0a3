"""The ``ProfileDrift`` condition: written from the autoscaler loop's scrapes, one tracker per LLMService.

What it is: :func:`track_drift`, called every built-in autoscaler tick with the
ready replicas' scrapes. It keeps a :class:`DriftTracker` per service (fresh
whenever a new profile is recorded — ``status.capacity.measuredAt`` changes —
or ``capacity.drift`` changes), and writes ``ProfileDrift`` through
``status_writer.py``: ``True`` with the numbers (or the engine version that
changed), ``False`` when the replicas match the profile or a new profile was
just recorded (reason ``Reprofiled``). On the transition to ``True`` it posts a
Warning Event and, with ``capacity.reprofile: Auto``, sets the
``plimsoll.dev/reprofile`` annotation so the profiler measures again.

What it is not: the comparison (``operator/scaling/drift.py``) or the profile
Job (``operator/handlers/profiling.py`` starts it on the annotation). The
engine version a profile was measured on is the first one seen after the
profile was recorded, kept in memory: an operator restarted after the version
changed takes the new one as its reference.
"""

import logging
import time
from dataclasses import dataclass
from typing import Any

import kopf

from plimsoll.operator.api.base import API_VERSION, KIND
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.status_writer import MAX_MESSAGE, update_status, with_conditions
from plimsoll.operator.scaling.drift import DriftTracker, DriftVerdict, curve_from_status
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.profile_plan import REPROFILE_ANNOTATION

Log = logging.Logger | logging.LoggerAdapter[Any]
# An unchanged verdict's numbers are refreshed at most this often.
REFRESH_S = 60.0


@dataclass
class DriftState:
    """What one service's loop carries for the drift check."""

    tracker: DriftTracker | None = None
    last_write: float = 0.0


def _condition(status: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == "ProfileDrift"), {})


async def _write(kube: Kube, svc: LLMService, verdict: DriftVerdict, status: str) -> str | None:
    """Set ProfileDrift on the freshest copy; the status it had before, or None when nothing was written."""

    def change(current: dict[str, Any]) -> dict[str, Any] | None:
        conditions = with_conditions(
            current.get("conditions"),
            (("ProfileDrift", status, verdict.reason, verdict.message),),  # type: ignore[list-item]
            svc.metadata.generation,
        )
        return {"conditions": conditions}

    written = await update_status(kube, svc.namespace, svc.name, change)
    if written is None:
        return None
    return str((written.condition_before("ProfileDrift") or {}).get("status", "Unknown"))


async def track_drift(
    kube: Kube,
    body: kopf.Body,
    svc: LLMService,
    state: DriftState,
    samples: dict[str, PodSample],
    now: float,
    logger: Log,
) -> DriftVerdict | None:
    """One tick of the drift check (see the module docstring); the verdict written, if any."""
    status = dict(body.get("status") or {})
    capacity = status.get("capacity") or {}
    if svc.spec.capacity.mode == "Manual" or not capacity.get("measuredAt"):
        state.tracker = None  # nothing measured to drift from
        return None
    spec = svc.spec.capacity.drift
    profile_id = str(capacity["measuredAt"])
    tracker = state.tracker
    fresh = (
        tracker is None
        or tracker.profile_id != profile_id
        or (tracker.margin, tracker.window_s, tracker.min_requests)
        != (spec.margin, float(spec.window_seconds), float(spec.min_requests))
    )
    if fresh:
        reprofiled = tracker is not None and tracker.profile_id != profile_id
        tracker = state.tracker = DriftTracker(
            curve=curve_from_status(capacity), margin=spec.margin, window_s=float(spec.window_seconds),
            min_requests=float(spec.min_requests), profile_id=profile_id,
        )  # fmt: skip
        if reprofiled and _condition(status).get("status") == "True":
            cleared = DriftVerdict(
                "False", "Reprofiled",
                f"a new profile was recorded at {profile_id}; replicas are compared with it from now on",
            )  # fmt: skip
            await _write(kube, svc, cleared, "False")
            kopf.info(body, reason="ProfileDriftCleared", message=cleared.message)
            state.last_write = now
            return cleared
    assert tracker is not None
    tracker.observe(now, samples)
    verdict = tracker.verdict(now)
    if verdict.status is None:
        return None
    current = _condition(status)
    same = (current.get("status"), current.get("reason")) == (verdict.status, verdict.reason)
    if same and now - state.last_write < REFRESH_S:
        return None
    before = await _write(kube, svc, verdict, verdict.status)
    state.last_write = now
    if before is not None and before != "True" and verdict.status == "True":
        await _raise(kube, body, svc, verdict, logger)
    return verdict


async def _raise(kube: Kube, body: kopf.Body, svc: LLMService, verdict: DriftVerdict, logger: Log) -> None:
    """The Warning, and with reprofile Auto the annotation the profiler acts on."""
    auto = svc.spec.capacity.reprofile == "Auto"
    then = (
        "re-profiling (capacity.reprofile Auto)"
        if auto
        else (f"annotate with {REPROFILE_ANNOTATION}=<anything> to re-measure")
    )
    message = f"{verdict.message}; {then}"[:MAX_MESSAGE]
    kopf.warn(body, reason="ProfileDrift", message=message)
    logger.warning("ProfileDrift: %s", message)
    if auto:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        await kube.merge_patch(
            API_VERSION, KIND, svc.namespace, svc.name,
            {"metadata": {"annotations": {REPROFILE_ANNOTATION: f"ProfileDrift {stamp}"}}},
        )  # fmt: skip
