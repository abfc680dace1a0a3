"""What the operator writes to ``spec.replicas`` while nobody has set it yet.

What it is: one pure rule, :func:`plan_start`, for an LLMService whose
``spec.replicas`` is unset:

- with ``spec.expectedLoad`` and a per-replica target known (override, Manual
  ``concurrencyPerReplica`` or the profile in ``status.capacity``): the sized
  count, ``clamp(ceil(in-flight / target), min, max)``, to be written to
  ``spec.replicas`` once (``Sized``);
- with ``expectedLoad`` but no target yet (Profile mode, sweep still running):
  start at ``scaling.min`` and write nothing, so the count is sized when the
  profile arrives (``WaitingForTarget``);
- without ``expectedLoad`` in ``hpa``/``keda`` mode: ``scaling.min`` written to
  ``spec.replicas``, because an HPA leaves a scale target at 0 replicas alone
  and an unset ``spec.replicas`` reads as 0 through the scale subresource
  (``ScaleTargetSeeded``).

Once ``spec.replicas`` holds a number it belongs to whoever writes it next (the
built-in autoscaler, an HPA, KEDA or the user) and this rule returns None, so
initial sizing never overrides a later decision.

What it is not: the arithmetic (``sizing.py``) or the I/O (``handlers/replica_planning.py``); the
replica planner (``planner.py``) applies it as its first rule.
"""

from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.api.base import camel_fields
from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.scaling.inputs import per_replica_target, starting_replicas
from plimsoll.operator.scaling.sizing import WAITING_FOR_TARGET, NoTargetError

SIZED = "Sized"
SCALE_TARGET_SEEDED = "ScaleTargetSeeded"


@dataclass(frozen=True, slots=True)
class StartPlan:
    """The starting replica count, whether to write it to ``spec.replicas`` now, and why."""

    replicas: int
    write: bool
    reason: str
    message: str
    formula: str | None = None
    inputs: dict[str, Any] = field(default_factory=dict)

    def to_status(self, now: str) -> dict[str, Any]:
        """The ``status.sizing`` block (merge patch: a None removes an earlier value)."""
        block = camel_fields(self, "replicas", "reason", "message", "formula")
        return {**block, "inputs": self.inputs or None, "time": now}

    def event_message(self) -> str:
        return f"{self.formula}; {self.message}" if self.formula else self.message


def _load_inputs(spec: LLMServiceSpec) -> dict[str, Any]:
    load = spec.expected_load
    assert load is not None
    raw = {
        "concurrency": load.concurrency,
        "requestsPerSecond": load.requests_per_second,
        "avgLatencySeconds": load.avg_latency_seconds,
    }
    return {k: v for k, v in raw.items() if v is not None}


def plan_start(spec: LLMServiceSpec, profiled: float | None) -> StartPlan | None:
    """The starting size for a spec with no ``replicas``; None when there is nothing to do."""
    if spec.replicas is not None:
        return None
    mode = spec.autoscaling.mode
    result = None
    try:
        result = starting_replicas(spec, profiled)
    except NoTargetError as error:
        start = spec.desired_replicas()
        return StartPlan(
            replicas=start,
            write=False,
            reason=WAITING_FOR_TARGET,
            message=f"starting at {start} (scaling.min) until a per-replica target is known: {error}; "
            "expectedLoad sizes the service then",
            inputs=_load_inputs(spec),
        )
    if result is not None:
        target = per_replica_target(spec, profiled)
        owner = {"builtin": "the built-in autoscaler", "hpa": "the HPA", "keda": "KEDA"}.get(
            mode, "you (autoscaling.mode off)"
        )
        replicas = result.replicas
        note = ""
        if mode == "hpa" and replicas == 0:
            replicas, note = 1, " (at least 1: an HPA leaves a target at 0 alone)"
        return StartPlan(
            replicas=replicas,
            write=True,
            reason=SIZED,
            message=f"{replicas} replicas written to spec.replicas{note}; {owner} owns the count from here",
            formula=result.formula,
            inputs={
                **_load_inputs(spec),
                "inFlight": result.in_flight,
                "targetInFlightPerReplica": target.value,
                "targetSource": target.source,
                **(
                    {"minReplicas": spec.scaling.min, "maxReplicas": spec.scaling.max} if spec.scaling else {}
                ),
            },
        )
    if mode in ("hpa", "keda"):
        # An HPA's minReplicas is at least 1 (build_hpa), and it ignores a target at 0.
        start = max(1, spec.desired_replicas()) if mode == "hpa" else spec.desired_replicas()
        return StartPlan(
            replicas=start,
            write=True,
            reason=SCALE_TARGET_SEEDED,
            message=f"spec.replicas set to scaling.min {start}: the {mode} autoscaler leaves a scale "
            "target at 0 replicas alone, and an unset spec.replicas reads as 0",
        )
    return None
