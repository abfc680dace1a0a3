"""Requests refused for want of room, counted as demand: a service that sheds load scales up.

What it is: :class:`ShedDemand`, fed every planner tick with the routers' refusals and the
replicas' admission refusals (cumulative counters, by reason). In-flight requests only show
what was admitted; a service that refuses at its door (SLO-aware admission's 429, a full
queue, a saturated router) looks busy but no busier, so the HPA formula alone would never
add the replica that would have served those requests. Over the last ``window_s``:

```
refused/s   = Δ refusals that say the service lacked room ÷ Δt
finished/s  = Δ requests the Ready replicas finished ÷ Δt
W           = in-flight ÷ finished/s               (Little's law: how long a request stays)
demand      = in-flight + refused/s × W            (the in-flight the refused requests would add)
replicas    = ceil(demand ÷ target per replica)    (floor for the HPA formula's stabilisation)
```

When nothing finished in the window while requests were refused (every replica stuck or
starting), there is no W to go by: one replica more than now is asked.

Which refusals count, and from where (each refused request once, as the client saw it):
with a router in front, the routers' own answers (``saturated``, ``replicas_full``,
``slo_ttft``, ``hold_full``, ``hold_timeout``); a replica's 429 there is retried on
another replica by the router and is in the router's count only when no replica took it.
Without a router (clients reach the replicas directly), the replicas' ``queue_full`` and
``slo_ttft``. Refusals that are the client's or the policy's (invalid request, tenant
limit, unauthenticated, draining) are not demand. The same counts are the misses
:func:`attainment_misses` hands the SLO attainment.

What it is not: the HPA formula (``autoscaler.py``) or a reader of the cluster; no I/O.
Counter resets (a restarted replica or router) count from zero, as ``rate()`` does.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.scaling.formula import fmt
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import RouterDemand
from plimsoll.prometheus import counter_increase

# The router's answers that say every replica was full, or would miss the request's TTFT bound.
ROUTER_DEMAND_REASONS = ("saturated", "replicas_full", "slo_ttft", "hold_full", "hold_timeout")
# A replica's admission refusals that say it had no room (``plimsoll_admission_rejections_total``).
REPLICA_DEMAND_REASONS = ("queue_full", "slo_ttft")
DEFAULT_WINDOW_S = 30.0


def demand_refusals(router: RouterDemand | None, samples: Mapping[str, PodSample]) -> dict[str, float]:
    """``source/reason`` -> cumulative refusals that say the service lacked room (see the module docstring).

    With a router that answered: its refusals per router pod (none yet is none); else the replicas' own.
    """
    if router is not None:
        return {
            f"router {name}/{reason}": float(count)
            for name, counts in router.refused.items()
            for reason, count in counts.items()
            if reason in ROUTER_DEMAND_REASONS
        }
    return {
        f"replica {name}/{reason}": float(count)
        for name, sample in samples.items()
        for reason, count in sample.refused.items()
        if reason in REPLICA_DEMAND_REASONS
    }


def attainment_misses(router: RouterDemand | None, samples: Mapping[str, PodSample]) -> dict[str, float]:
    """The refusals the SLO attainment counts as judged and not good, by ``source/reason``.

    A replica judges its own ``slo_ttft`` refusals (a bad request in ``plimsoll_slo_requests_total``),
    so those are left out here; everything else a client was refused for want of room is a miss.
    """
    misses = {
        k: v
        for k, v in demand_refusals(router, samples).items()
        if not (k.startswith("replica ") and k.endswith("/slo_ttft"))
    }
    if router is not None and not router.refused and router.shed_slo_total:
        misses["router/slo_ttft"] = router.shed_slo_total  # a router that does not say refusedTotal yet
    return misses


@dataclass(frozen=True, slots=True)
class _Tick:
    time: float
    refused: dict[str, float]  # source/reason -> cumulative
    finished: dict[str, float]  # pod -> cumulative finished requests


def _delta(now: Mapping[str, float], before: Mapping[str, float]) -> float:
    total = 0.0
    for key, value in now.items():
        base = before.get(key, 0.0)
        total += counter_increase(value, base)
    return total


@dataclass(frozen=True, slots=True)
class ShedRate:
    """Refusals and finished requests per second over the window, and the refusals by reason."""

    window_s: float
    refused_per_s: float
    finished_per_s: float
    by_reason: dict[str, float]  # reason -> per second


@dataclass
class ShedDemand:
    """One LLMService's refusal and finished-request counters over the last ``window_s``."""

    window_s: float = DEFAULT_WINDOW_S
    ticks: deque[_Tick] = field(default_factory=deque)

    def observe(self, now: float, refused: Mapping[str, float], samples: Mapping[str, PodSample]) -> None:
        finished = {n: s.requests_finished for n, s in samples.items() if s.requests_finished is not None}
        self.ticks.append(_Tick(now, dict(refused), finished))
        while len(self.ticks) >= 2 and self.ticks[1].time <= now - self.window_s:
            self.ticks.popleft()

    def rate(self) -> ShedRate | None:
        """Over the window (the oldest tick kept to the newest); None before there is an interval."""
        if len(self.ticks) < 2:
            return None
        base, last = self.ticks[0], self.ticks[-1]
        span = last.time - base.time
        if span <= 0:
            return None
        by_reason: dict[str, float] = {}
        for key in last.refused:
            reason = key.rsplit("/", 1)[-1]
            by_reason[reason] = (
                by_reason.get(reason, 0.0) + _delta({key: last.refused[key]}, base.refused) / span
            )
        # A pod that left since the base is not in the newest tick: only pods scraped now count.
        finished = _delta(last.finished, base.finished) / span
        return ShedRate(
            span, sum(by_reason.values()), finished, {k: v for k, v in by_reason.items() if v > 0}
        )


@dataclass(frozen=True, slots=True)
class ShedSignal:
    """The shed-demand rule's verdict: a replica count to hold at least (None: nothing was refused)."""

    recommendation: int | None
    formula: str
    rate: ShedRate | None

    def to_status(self) -> dict[str, Any]:
        rate = self.rate
        return {
            "formula": self.formula,
            "recommendation": self.recommendation,
            "refusedPerSecond": round(rate.refused_per_s, 3) if rate else None,
            "refusedPerSecondByReason": {k: round(v, 3) for k, v in sorted(rate.by_reason.items())}
            if rate
            else {},
            "finishedPerSecond": round(rate.finished_per_s, 3) if rate else None,
            "windowSeconds": round(rate.window_s, 1) if rate else None,
        }


def shed_recommendation(rate: ShedRate | None, in_flight: float, target: float, current: int) -> ShedSignal:
    """Replicas for the admitted in-flight plus what the refused requests would add (module docstring)."""
    if rate is None:
        return ShedSignal(None, "shed: no interval yet", None)
    if rate.refused_per_s <= 0:
        return ShedSignal(None, f"shed: nothing refused for want of room in {fmt(rate.window_s)} s", rate)
    reasons = ", ".join(f"{k} {fmt(v)}" for k, v in sorted(rate.by_reason.items()))
    if rate.finished_per_s <= 0:
        wanted = current + 1
        return ShedSignal(
            wanted,
            f"shed: {fmt(rate.refused_per_s)} req/s refused ({reasons}) and none finished in "
            f"{fmt(rate.window_s)} s: {current} + 1 = {wanted}",
            rate,
        )
    stay = in_flight / rate.finished_per_s
    demand = in_flight + rate.refused_per_s * stay
    wanted = max(1, math.ceil(demand / target - 1e-9))
    return ShedSignal(
        wanted,
        f"shed: {fmt(rate.refused_per_s)} req/s refused ({reasons}) × {fmt(stay)} s per request "
        f"(in-flight {fmt(in_flight)} ÷ {fmt(rate.finished_per_s)} finished/s); "
        f"ceil(({fmt(in_flight)} + {fmt(rate.refused_per_s * stay)}) / {fmt(target)}) = {wanted}",
        rate,
    )
