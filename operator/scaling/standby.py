"""Warm standby: replicas parked asleep (vLLM's sleep mode) beside the active ones, woken in a second.

What it is: :class:`Standby`, the planner's last rule when ``autoscaling.standby`` is
set. The Deployment runs ``spec.replicas`` active replicas plus
``standby.replicas`` parked ones; a parked pod carries the label
``plimsoll.dev/standby=true`` (the router sends it nothing) and sleeps at
``standby.level`` (``POST /sleep``: level 1 frees the KV cache and moves the weights
to host memory, level 2 drops them). Every tick, against the count the plan leaves:

- **too few active** pods (a scale-up, the first request at zero): wake parked ones
  (``POST /wake_up``, label off) — asleep ones first, they answer within about a
  second, where a new pod would take a cold start;
- **too many active** pods (the pods the Deployment starts to refill the pool, the
  replicas a scale-down drained): park the surplus, starting pods first (they serve
  nothing yet), then the idle ones; a pod a drain still holds is left to it;
- parked pods stay parked: the action is stated again each tick, so a restarted
  replica goes back to sleep.

A router in front wakes a parked replica itself the moment every awake one is past its
target (``router/standby_wake.py``) and says so in ``GET /hold``; the planner counts each
such pod as a scale-up (one more replica) and takes it in first, or, when the count does
not rise, parks it again once it is idle.

The time from a wake to the pod Ready is measured (``lastWakeSeconds``) and is what
the predicted-TTFT rule expects a new replica to take while a parked one is left.
``status.standby`` says what standby costs: parked pods, how many sleep, the host
memory they hold (their ``process_resident_memory_bytes``).

What it is not: the sleep itself (``runtime/engine/sleep_mode.py``) or the calls
(``operator/handlers/replica_planning.py`` through ``pod_http.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.scaling.observations import Observations, PodObservation
from plimsoll.operator.scaling.replica_plan import PlanDraft

# A wake not seen Ready after this long is forgotten (the pod went, or its engine restarted).
WAKE_GIVE_UP_S = 120.0


def _wake_order(pod: PodObservation, router_woken: frozenset[str] = frozenset()) -> tuple[int, str]:
    if pod.name in router_woken:
        return -1, pod.name  # a router woke it and sends it requests already
    sample = pod.sample
    if sample is not None and sample.sleep_level > 0:
        return 0, pod.name  # loaded and asleep: back in about a second
    if sample is not None:
        return 1, pod.name  # loaded, not yet asleep: back at once
    return 2, pod.name  # still starting: no faster than a new pod


def _park_order(pod: PodObservation) -> tuple[int, float, str]:
    if not pod.ready:
        return 0, 0.0, pod.name  # starting (or not serving): parking it costs nothing
    in_flight = pod.sample.in_flight if pod.sample is not None else 0.0
    return 1, in_flight, pod.name


@dataclass
class Standby:
    """Parked-pod state of one service across ticks: wakes under way, the last wake's time."""

    waking: dict[str, float] = field(default_factory=dict)  # pod -> when its wake was decided
    # Pods a router woke that this rule took in (pod -> when): counted once, while their label goes.
    adopted: dict[str, float] = field(default_factory=dict)
    last_wake_s: float | None = None

    @classmethod
    def from_status(cls, block: dict[str, Any] | None) -> Standby:
        last = (block or {}).get("lastWakeSeconds")
        return cls(last_wake_s=float(last) if last is not None else None)

    def plan(
        self, draft: PlanDraft, obs: Observations, active_target: int, replicas: int, level: int,
        held: frozenset[str], router_woken: frozenset[str] = frozenset(),
    ) -> None:  # fmt: skip
        """Wake or park so that ``active_target`` pods are active; keep the parked asleep at ``level``.

        ``held`` are pods a drain (or a removal) owns this tick: neither woken nor parked here.
        ``router_woken`` are parked pods a router woke itself: taken in first.
        """
        now = draft.now
        counted = [p for p in obs.counted if p.name not in held]
        parked = [p for p in counted if p.standby]
        active = [p for p in counted if not p.standby]
        for pod in active:
            started = self.waking.get(pod.name)
            if started is not None and pod.ready:
                self.last_wake_s = round(now - started, 3)
                del self.waking[pod.name]
                draft.must_write = True
        present = {p.name for p in obs.pods}
        for name, started in list(self.waking.items()):
            if name not in present or now - started > WAKE_GIVE_UP_S:
                del self.waking[name]
        still_parked = {p.name for p in parked}
        for name, started in list(self.adopted.items()):
            if name not in still_parked or now - started > WAKE_GIVE_UP_S:
                del self.adopted[name]
        deficit = active_target - len(active)
        woken: set[str] = set()
        if deficit > 0:
            for pod in sorted(parked, key=lambda p: _wake_order(p, router_woken))[:deficit]:
                draft.wake(pod.name, f"{len(active)} active of {active_target}: woken from standby")
                if pod.name in router_woken:  # awake already: its wake is not the operator's to time
                    self.adopted.setdefault(pod.name, now)
                else:
                    self.waking.setdefault(pod.name, now)
                woken.add(pod.name)
            if woken:
                draft.event("Normal", "WokenFromStandby",
                            f"{', '.join(sorted(woken))}: {len(active)} active replica(s), {active_target} wanted; "
                            f"woken from sleep level {level} instead of started"
                            + (f" ({', '.join(sorted(woken & router_woken))} by the router, when every awake "
                               "replica passed its target)" if woken & router_woken else ""))  # fmt: skip
        elif deficit < 0:
            surplus = sorted(active, key=_park_order)[:-deficit]
            for pod in surplus:
                draft.park(pod.name, level, f"{len(active)} active of {active_target}: parked in standby")
            if surplus:
                draft.event("Normal", "ParkedInStandby",
                            f"{', '.join(p.name for p in surplus)}: parked asleep (level {level}); "
                            f"{len(parked) + len(surplus)} in standby of {replicas}")  # fmt: skip
        for pod in parked:
            if pod.name not in woken:
                draft.park(pod.name, level, "in standby")

    def to_status(self, obs: Observations, replicas: int, level: int) -> dict[str, Any]:
        """``status.standby``: what is parked, asleep, and the host memory it holds."""
        parked = [p for p in obs.parked if p.name not in self.waking]
        asleep = [p for p in parked if p.sample is not None and p.sample.sleep_level > 0]
        memory = [p.sample.resident_bytes for p in parked if p.sample is not None and p.sample.resident_bytes]
        return {
            "replicas": replicas,
            "level": level,
            "parked": len(parked),
            "asleep": len(asleep),
            "pods": sorted(p.name for p in parked),
            "memoryBytes": int(sum(memory)) if memory else None,
            "lastWakeSeconds": self.last_wake_s,
        }
