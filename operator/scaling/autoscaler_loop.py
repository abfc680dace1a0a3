"""The built-in autoscaler loop's pure half: what it carries between ticks and what it writes.

What it is: :class:`LoopState` (the scaler and the replica count a loop last saw
or wrote, so a count another writer set restarts the history), :func:`status_patch`
(``status.autoscaler`` and the ``ScalingLimited`` / ``SLOAtRisk`` conditions for a
decision), the rule for when a ``ScalingLimited`` Warning is due, and when an
unchanged decision is worth writing again.

What it is not: the decision itself (``autoscaler.py``) or the loop that scrapes,
patches and posts Events (``operator/handlers/autoscaling.py``). No I/O.
"""

from dataclasses import dataclass
from typing import Any

from plimsoll.operator.api.status import ConditionStatus, set_condition
from plimsoll.operator.scaling.autoscaler import Autoscaler, AutoscalerConfig, Decision
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.scale_up_timeline import ScaleUpTimeline

# ScalingLimited=False (reason, message) when the decision touched a bound that is not a problem.
_WITHIN_RANGE = ("DesiredWithinRange", "desired {desired} within bounds")
_QUIET_LIMITS = {
    "TooFewReplicas": ("AtMinReplicas", "at min {min} with less load than it can carry; normal when idle"),
    "ScaleUpLimit": ("ScaleUpRateLimited", "adding replicas as fast as the scale-up rate policy allows"),
}


def status_patch(
    previous: dict[str, Any], decision: Decision, generation: int | None, slo: tuple[str, str, str] | None
) -> dict[str, Any]:
    """``status.autoscaler`` plus the ScalingLimited (and, when checked, SLOAtRisk) conditions."""
    conditions = list(previous.get("conditions") or [])
    if decision.scaling_limited:
        conditions = set_condition(
            conditions, "ScalingLimited", "True", decision.limited_reason or "Limited",
            decision.event_message(), observed_generation=generation,
        )  # fmt: skip
    else:
        # Idle at min and a passing rate limit are normal operation: False, with the reason spelled out.
        reason, message = _QUIET_LIMITS.get(decision.limited_reason or "", _WITHIN_RANGE)
        conditions = set_condition(
            conditions, "ScalingLimited", "False", reason,
            message.format(desired=decision.desired_replicas, min=decision.min_replicas),
            observed_generation=generation,
        )  # fmt: skip
    if slo is not None:
        state: ConditionStatus = "True" if slo[0] == "True" else "False" if slo[0] == "False" else "Unknown"
        conditions = set_condition(
            conditions, "SLOAtRisk", state, slo[1], slo[2], observed_generation=generation
        )
    return {"autoscaler": decision.to_status(), "conditions": conditions}


def warn_scaling_limited(decision: Decision, conditions: list[dict[str, Any]] | None) -> bool:
    """A ScalingLimited Warning only when the service just reached max while still overloaded."""
    was = condition_states(conditions).get("ScalingLimited")
    return decision.scaling_limited and was != "True"


# Not the decision's: the time changes every tick, lastScaleUp is written by the scale-up timeline.
_NOT_COMPARED = ("time", "lastScaleUp")


def same_decision(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    # Only write when something a reader cares about changed.
    if a is None:
        return False
    return {k: v for k, v in a.items() if k not in _NOT_COMPARED} == {
        k: v for k, v in b.items() if k not in _NOT_COMPARED
    }


def condition_states(conditions: list[dict[str, Any]] | None) -> dict[str, str]:
    return {str(c.get("type")): str(c.get("status")) for c in conditions or []}


@dataclass
class LoopState:
    """What one LLMService's loop carries from tick to tick."""

    scaler: Autoscaler | None = None
    last_now: float = 0.0
    last_write: float = 0.0
    slo_base: tuple[float, dict[str, PodSample]] | None = None
    # The replica count the loop last saw or wrote; anything else means another writer moved it.
    replicas: int | None = None
    # The count before the loop's own last write: the body may still show it for a tick.
    replaced: int | None = None
    # Since when in-flight per replica has been above the target (None: not above), and the
    # scale-up being followed to its new pod's first answer.
    crossed_at: float | None = None
    timeline: ScaleUpTimeline | None = None

    def needs_fresh_scaler(self, config: AutoscalerConfig, current: int) -> bool:
        """No scaler yet, a new target or bounds, or replicas moved by another writer."""
        moved = self.replicas is not None and current not in (self.replicas, self.replaced)
        return self.scaler is None or self.scaler.config != config or moved

    def saw_metric(self, now: float, metric: float | None, target: float) -> None:
        """Note when in-flight per replica first went above the target (the scale-up timeline's start)."""
        if metric is not None and metric > target:
            if self.crossed_at is None:
                self.crossed_at = now
        else:
            self.crossed_at = None

    def saw(self, current: int, desired: int) -> None:
        """Remember the count this tick saw and the one it decided (written when they differ)."""
        self.replicas, self.replaced = desired, (current if desired != current else None)
