"""The ``ProfileDrift`` condition, from the replica-planning tick's scrapes, one tracker per LLMService.

What it is: :class:`DriftState`, kept by the replica-planning loop. Every tick
:meth:`DriftState.check` feeds the ready replicas' scrapes to a
:class:`DriftTracker` (fresh whenever a new profile is recorded —
``status.capacity.measuredAt`` changes — or ``capacity.drift`` changes) and
says what ``ProfileDrift`` should now read: ``True`` with the numbers (or the
engine version that changed), ``False`` when the replicas match the profile or
a new profile was just recorded (reason ``Reprofiled``), or nothing to write.
The loop writes it in the tick's one status write; :func:`after_write` then,
on the transition to ``True``, posts a Warning Event and, with
``capacity.reprofile: Auto``, sets the ``plimsoll.dev/reprofile`` annotation
so the profiler measures again.

What it is not: the comparison (``operator/scaling/drift.py``) or the profile
Job (``operator/handlers/profiling.py`` starts it on the annotation). The
engine version a profile was measured on is the first one seen after the
profile was recorded, kept in memory: an operator restarted after the version
changed takes the new one as its reference.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plimsoll.operator.api.base import API_VERSION, KIND
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import ConditionUpdate
from plimsoll.operator.handlers.handler_types import Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.status_writer import MAX_MESSAGE
from plimsoll.operator.scaling.drift import DriftTracker, DriftVerdict, curve_from_status
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.profile_plan import REPROFILE_ANNOTATION

# (type, reason, message) -> an Event on the LLMService.
PostEvent = Callable[[str, str, str], None]
# An unchanged verdict's numbers are refreshed at most this often.
REFRESH_S = 60.0


@dataclass(frozen=True, slots=True)
class DriftUpdate:
    """What ProfileDrift should read now; ``cleared``: a new profile ended an earlier drift."""

    verdict: DriftVerdict
    status: str
    cleared: bool = False

    def condition(self) -> ConditionUpdate:
        return ("ProfileDrift", self.status, self.verdict.reason, self.verdict.message)  # type: ignore[return-value]


def _condition(status: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == "ProfileDrift"), {})


@dataclass
class DriftState:
    """What one service's loop carries for the drift check."""

    tracker: DriftTracker | None = None
    last_write: float = 0.0

    def check(
        self, svc: LLMService, status: dict[str, Any], samples: dict[str, PodSample], now: float
    ) -> DriftUpdate | None:
        """One tick of the drift check (see the module docstring); what to write, if anything."""
        capacity = status.get("capacity") or {}
        if svc.spec.capacity.mode == "Manual" or not capacity.get("measuredAt"):
            self.tracker = None  # nothing measured to drift from
            return None
        spec = svc.spec.capacity.drift
        profile_id = str(capacity["measuredAt"])
        tracker = self.tracker
        fresh = (
            tracker is None
            or tracker.profile_id != profile_id
            or (tracker.margin, tracker.window_s, tracker.min_requests)
            != (spec.margin, float(spec.window_seconds), float(spec.min_requests))
        )
        if fresh:
            reprofiled = tracker is not None and tracker.profile_id != profile_id
            tracker = self.tracker = DriftTracker(
                curve=curve_from_status(capacity), margin=spec.margin, window_s=float(spec.window_seconds),
                min_requests=float(spec.min_requests), profile_id=profile_id,
            )  # fmt: skip
            if reprofiled and _condition(status).get("status") == "True":
                cleared = DriftVerdict(
                    "False", "Reprofiled",
                    f"a new profile was recorded at {profile_id}; replicas are compared with it from now on",
                )  # fmt: skip
                self.last_write = now
                return DriftUpdate(cleared, "False", cleared=True)
        assert tracker is not None
        tracker.observe(now, samples)
        verdict = tracker.verdict(now)
        if verdict.status is None:
            return None
        current = _condition(status)
        same = (current.get("status"), current.get("reason")) == (verdict.status, verdict.reason)
        if same and now - self.last_write < REFRESH_S:
            return None
        self.last_write = now
        return DriftUpdate(verdict, verdict.status)


async def after_write(
    kube: Kube, svc: LLMService, update: DriftUpdate, before: str | None, post: PostEvent, logger: Log,
    variant: str | None = None,
) -> None:  # fmt: skip
    """Once the condition is written: the Events, and with reprofile Auto the annotation the profiler acts on.

    ``before`` is ProfileDrift's status in the copy the write started from (None: it was not written).
    ``variant``: the hardware variant that drifted, named in the annotation so only it is measured again.
    """
    if update.cleared:
        post("Normal", "ProfileDriftCleared", update.verdict.message)
        return
    if before is None or before == "True" or update.status != "True":
        return
    auto = svc.spec.capacity.reprofile == "Auto"
    then = (
        "re-profiling (capacity.reprofile Auto)"
        if auto
        else (f"annotate with {REPROFILE_ANNOTATION}=<anything> to re-measure")
    )
    message = f"{update.verdict.message}; {then}"[:MAX_MESSAGE]
    post("Warning", "ProfileDrift", message)
    logger.warning("ProfileDrift: %s", message)
    if auto:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        await kube.merge_patch(
            API_VERSION, KIND, svc.namespace, svc.name,
            {"metadata": {"annotations": {REPROFILE_ANNOTATION: f"ProfileDrift {stamp}"
                                          + (f" variant={variant}" if variant else "")}}},
        )  # fmt: skip
