"""The planner's removal side: drains, scale to zero and back, cold starts, requests cut.

What it is: :class:`ScalePhases`, the state one LLMService carries for the
rules that take a tick over from the HPA formula, and those rules:

- :meth:`at_zero`: at zero with ``scaling.min: 0``, a held request wakes
  ``max(1, min)`` replicas and starts a cold-start measurement; otherwise the
  first tick at zero says so in ``ScalingLimited`` (reason ``ScaledToZero``);
- :meth:`begin_drain` (phase one of a scale-down, or of the way to zero) and
  :meth:`drain_step` (every tick after: keep the pods marked, lower the count
  once they are empty or the drain time is up, call it off when the load
  comes back or another writer moves the count);
- :meth:`book`: cold starts that ended, what the removed pods' shutdown cut, and
  removed pods kept marked until the ReplicaSet deletes them;
- :meth:`unmark_strays`: a pod that carries the mark but that no drain holds.

It is built from status (:meth:`from_status`), so a drain survives an operator
restart, and written back to ``status.scaleDown`` (:meth:`to_status`).

What it is not: the arithmetic of each step (``drain.py``, ``scale_to_zero.py``,
``cold_start.py``), the rule order (``planner.py``) or any I/O.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.scaling.autoscaler import AutoscalerConfig
from plimsoll.operator.scaling.cold_start import ColdStartClock
from plimsoll.operator.scaling.drain import CutTally, DrainPlan, overloaded
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import Observations
from plimsoll.operator.scaling.replica_plan import PlanDraft
from plimsoll.operator.scaling.scale_to_zero import IdleClock, wake_replicas

# A removed pod the ReplicaSet has not begun deleting this long after the count went down was kept
# (the count went back up first): its mark comes off.
REMOVAL_GRACE_S = 60.0
_REMOVED = "removed; waiting for the ReplicaSet to delete it"


@dataclass
class ScalePhases:
    """Zero, drain and cold-start state of one service (see the module docstring)."""

    idle: IdleClock
    cold: ColdStartClock
    tally: CutTally
    cut_total: float
    drain: DrainPlan | None = None
    removed: dict[str, float] = field(default_factory=dict)  # pod -> when its count went down
    note: dict[str, Any] = field(default_factory=dict)  # how the last drain went, for status.scaleDown
    zero_reported: bool = False
    # With autoscaling.standby the replicas a drain emptied are parked (standby.py), not left marked for
    # the ReplicaSet to delete: the Deployment then shrinks by deleting parked pods.
    park_removed: bool = False

    @classmethod
    def from_status(
        cls, status: dict[str, Any], obs: Observations, spec: LLMServiceSpec, now: float
    ) -> "ScalePhases":
        cold = ColdStartClock.from_status(status.get("coldStart"))
        ready = sum(p.ready for p in obs.counted)
        if not cold.samples and ready == 0 and obs.created_at is not None and spec.desired_replicas() > 0:
            cold.needed(obs.created_at)  # the very first start is a cold start too, from the creation
        block = status.get("scaleDown") or {}
        cut_total = float(block.get("requestsCutTotal") or 0.0)
        phases = cls(IdleClock(now), cold, CutTally(cut_total), cut_total, DrainPlan.from_status(block, now))
        if block.get("phase") in ("Drained", "DrainTimeout"):
            # The count went down just before a restart: those pods stay marked until they are deleted.
            for pod in block.get("lastPods") or []:
                phases.removed[str(pod)] = now
                phases.tally.watch(str(pod))
        return phases

    def to_status(self) -> dict[str, Any]:
        """``status.scaleDown`` (merge patch: the Idle block clears the last drain's pods and start)."""
        idle = {"phase": "Idle", "pods": None, "startedAt": None}
        drain = self.drain.to_status() if self.drain is not None else idle
        return {**drain, **self.note, "requestsCutTotal": self.cut_total}

    def book(self, draft: PlanDraft, obs: Observations) -> None:
        """Every tick: a cold start that ended, the cut tally, and removed pods kept marked."""
        ready = sum(p.ready for p in obs.counted)
        if self.cold.seen_ready(draft.now, ready):
            draft.must_write = True
        present = {p.name: p for p in obs.pods}
        for name in self.tally.watched:
            sample = present[name].sample if name in present else None
            if sample is not None:
                self.tally.observe(name, sample.requests_cut)
        added = self.tally.settle(present)
        if added:
            draft.requests_cut = added
            draft.event("Warning", "RequestsCut", f"{added:g} request(s) were cut by a scale-down's shutdown")
        if self.tally.total != self.cut_total:
            self.cut_total = self.tally.total
            draft.must_write = True
        for name, since in list(self.removed.items()):
            pod = present.get(name)
            if pod is None or (not pod.terminating and draft.now - since > REMOVAL_GRACE_S):
                del self.removed[name]  # gone, or kept by the ReplicaSet: unmark_strays takes the mark off
            elif not pod.terminating:
                draft.drain(name, _REMOVED)

    def at_zero(
        self, draft: PlanDraft, obs: Observations, config: AutoscalerConfig, idle_seconds: int
    ) -> None:
        """Zero replicas with ``scaling.min: 0``: wake for a held request, else say once why it is at zero."""
        if obs.held > 0:
            wake = wake_replicas(config.min_replicas)
            oldest = obs.router.oldest_held_s if obs.router is not None else None
            draft.count(0, wake, "ScaledFromZero", f"max(1, scaling.min {config.min_replicas}) = {wake}")
            self.cold.needed(draft.now, oldest)
            self.idle.last_activity = draft.now
            self.zero_reported = False
            draft.event("Normal", "ScaledFromZero", f"0 → {wake}: {obs.held} request(s) held by the router "
                        f"(oldest {oldest} s); it releases them once a replica is Ready")  # fmt: skip
        elif not self.zero_reported:
            draft.conditions.append((
                "ScalingLimited", "False", "ScaledToZero",
                f"scaled to zero after {idle_seconds} s without requests; the router holds the next "
                "request and a replica starts for it",
            ))  # fmt: skip
            self.zero_reported = True
            draft.must_write = True

    def begin_drain(
        self, draft: PlanDraft, victims: tuple[str, ...], current: int, target: int, drain_s: float,
        purpose: str, why: str,
    ) -> None:  # fmt: skip
        """Phase one: mark the chosen pods; the count stays until they are empty (:meth:`drain_step`)."""
        self.drain = DrainPlan(victims, current, target, draft.now, drain_s, purpose)
        self.note = {
            "reason": "Draining",
            "message": f"{why}; draining {', '.join(victims) or 'nothing'} first",
        }
        for name in victims:
            draft.drain(name, purpose)
        draft.event("Normal", "DrainStarted",
                    f"{current} → {target}: draining {', '.join(victims)} (no new requests; up to {drain_s:g} s "
                    f"for in-flight ones) before lowering the count; {why}")  # fmt: skip
        draft.must_write = True

    def drain_step(
        self, draft: PlanDraft, obs: Observations, config: AutoscalerConfig, current: int,
        load_of: Callable[[PodSample], float] | None = None,
    ) -> None:  # fmt: skip
        """Phase two, every tick of a drain: keep marking, lower the count, or call it off.

        ``load_of``: each kept pod's load in the target's unit (in-flight unless given: a split service's
        decode load); a drained pod is empty when its in-flight is zero either way."""
        plan = self.drain
        assert plan is not None
        present = {p.name: p for p in obs.pods}
        loads: dict[str, float | None] = {}
        for name in plan.pods:
            if name in present:
                pod = present[name]
                # Silent and not Ready: nothing is routed to it either, so it holds nothing.
                loads[name] = pod.sample.in_flight if pod.sample is not None else (None if pod.ready else 0.0)
        kept = [(load_of or _in_flight)(s) for n, s in obs.ready_samples().items() if n not in plan.pods]
        why = None
        if current != plan.from_replicas:
            why = f"spec.replicas moved to {current} by another writer"
        elif plan.purpose == "ScaleToZero" and obs.held > 0:
            why = f"{obs.held} request(s) arrived"
        elif plan.purpose == "ScaleDown" and overloaded(kept, config.target_per_replica, config.tolerance):
            why = f"the replicas that stay hold more than {config.target_per_replica:g} each"
        live = [name for name in plan.pods if name in present and not present[name].terminating]
        if why is not None:
            message = f"drain of {', '.join(plan.pods)} called off: {why}; staying at {current}"
            for name in live:
                draft.undrain(name, "drain called off")
            draft.event("Normal", "DrainCancelled", message)
            self.drain, self.note = None, {"reason": "DrainCancelled", "message": message}
            self.idle.last_activity = draft.now
            draft.must_write = True
            return
        step = plan.step(draft.now, loads)
        if not step.done:
            for name in live:
                draft.drain(name, f"{plan.purpose}: {step.message}")
            return
        reason = "ScaledToZero" if plan.to_replicas == 0 else "ScaledDown"
        formula = f"{plan.from_replicas} − {len(plan.pods)} drained = {plan.to_replicas}"
        draft.count(plan.from_replicas, plan.to_replicas, reason, formula)
        fate = "parking exactly those pods in standby" if self.park_removed else "removing exactly those pods"
        message = f"{plan.from_replicas} → {plan.to_replicas}: {step.message}; {fate}"
        draft.event("Normal" if step.reason == "Drained" else "Warning", reason, message)
        for name in plan.pods:
            self.tally.watch(name)
        for name in live if not self.park_removed else ():
            self.removed[name] = draft.now
            draft.drain(name, _REMOVED)
        self.note = {"reason": step.reason, "message": message, "lastPods": list(plan.pods)}
        self.drain = None

    def unmark_strays(self, draft: PlanDraft, obs: Observations) -> None:
        """A pod marked for removal that no drain holds (a drain called off, a restart, a kept pod): unmark it."""
        holding = set(self.drain.pods if self.drain is not None else ()) | set(self.removed)
        for pod in obs.pods:
            stray = pod.draining and not pod.terminating and pod.name not in holding
            if stray and pod.name not in draft.actions:
                draft.undrain(pod.name, "marked for removal, but no drain holds it")


def _in_flight(sample: PodSample) -> float:
    return float(sample.in_flight)
