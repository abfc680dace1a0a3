"""Live SLO attainment and what it costs: the fraction of good requests, and replica-seconds per 1000 of them.

What it is: :class:`AttainmentTracker`, fed every autoscaler tick with the
ready replicas' scrapes and the number of replicas that exist (ready or not:
a starting replica costs as much as a serving one). Each plimsoll replica
judges every finished request against the per-request bounds the operator
set on it (``PUT /slo`` with ``spec.slo``; counter
``plimsoll_slo_requests_total{result="good"|"bad"}``), the same rule bench's
load generator applies to its own records: a request is good when it
succeeded and its TTFT, TPOT and end-to-end latency are each within the bound
set. The tracker turns counter deltas over a window into

- :meth:`attainment` — good ÷ judged over the last ``window`` seconds (1 min, 1 h;
  since the tracker started while that is shorter);
- :meth:`replica_seconds_per_1k_good` — ∫ replicas dt ÷ (good ÷ 1000) over the same window;
- :meth:`spent` — ∫ cost per hour dt over the window, when each tick was told what the
  replicas cost (``spec.variants[].costPerHour``): ``status.cost``'s cost per 1000 good requests.

What it is not: an estimate from latency histograms (a request's TTFT and
TPOT are binned apart, so "both within bounds" cannot be read back from
them), so replicas that do not judge requests (vLLM, a plimsoll too old to
have ``/slo``) are left out, and with none left there is no figure. Counter
resets (a restarted replica) count from zero, as ``rate()`` does. No I/O.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from plimsoll.operator.scaling.metrics import PodSample

WINDOWS_S = {"1m": 60.0, "1h": 3600.0}
# The cost figure's window.
COST_WINDOW = "1h"


def objectives_seconds(
    ttft_p95_ms: float | None, tpot_p50_ms: float | None, e2e_p95_ms: float | None
) -> dict[str, float]:
    """``spec.slo`` as the per-request bounds a replica exports (objective -> seconds)."""
    pairs = (("ttft", ttft_p95_ms), ("tpot", tpot_p50_ms), ("e2e", e2e_p95_ms))
    return {k: ms / 1000 for k, ms in pairs if ms is not None}


def needs_objectives(sample: PodSample, wanted: Mapping[str, float]) -> bool:
    """A plimsoll replica whose bounds differ from ``wanted`` (restarted, or the SLO changed)."""
    if sample.engine != "plimsoll" or not wanted:
        return False
    have = sample.slo_objectives
    return set(have) != set(wanted) or any(abs(have[k] - v) > 1e-9 for k, v in wanted.items())


@dataclass(frozen=True, slots=True)
class _Tick:
    time: float
    counts: dict[str, tuple[float, float]]  # pod -> (good, judged), cumulative
    replicas: int
    cost_per_hour: float | None = None


@dataclass
class AttainmentTracker:
    """One LLMService's judged-request counters over the last hour."""

    objectives: dict[str, float]  # what the replicas were told; a change starts afresh
    ticks: deque[_Tick] = field(default_factory=deque)

    def observe(
        self,
        now: float,
        samples: Mapping[str, PodSample],
        replicas: int,
        cost_per_hour: float | None = None,
        shed: Mapping[str, float] | None = None,
    ) -> None:
        """One tick; ``shed`` are cumulative counts of requests refused before any replica judged them
        (the router's predicted-TTFT refusals, by router), each one judged and not good."""
        counts = {
            name: (s.slo_good, s.slo_good + s.slo_bad)
            for name, s in samples.items()
            if s.slo_good is not None and s.slo_bad is not None and s.slo_objectives == self.objectives
        }
        for name, total in (shed or {}).items():
            counts[f"shed:{name}"] = (0.0, total)
        self.ticks.append(_Tick(now, counts, replicas, cost_per_hour))
        horizon = now - max(WINDOWS_S.values())
        while len(self.ticks) >= 2 and self.ticks[1].time <= horizon:
            self.ticks.popleft()

    def _base(self, window_s: float) -> _Tick | None:
        """The newest tick at or before the window's start (the oldest while the history is shorter).

        None with fewer than two ticks: there is no interval yet.
        """
        if len(self.ticks) < 2:
            return None
        start = self.ticks[-1].time - window_s
        base = self.ticks[0]
        for tick in self.ticks:
            if tick.time <= start:
                base = tick
        return base

    def counted(self, window_s: float) -> tuple[float, float] | None:
        """(good, judged) over the window; None before there is an interval."""
        base = self._base(window_s)
        if base is None:
            return None
        good = judged = 0.0
        for pod, (g, n) in self.ticks[-1].counts.items():
            before = base.counts.get(pod, (0.0, 0.0))
            if before[1] > n:  # restarted: its whole count is in the window
                before = (0.0, 0.0)
            good += g - before[0]
            judged += n - before[1]
        return good, judged

    def attainment(self, window_s: float) -> float | None:
        """Good ÷ judged over the window; None without judged requests."""
        counted = self.counted(window_s)
        if counted is None or counted[1] <= 0:
            return None
        return counted[0] / counted[1]

    def replica_seconds(self, window_s: float) -> float | None:
        """∫ replicas dt over the window (each tick's count held until the next)."""
        base = self._base(window_s)
        if base is None:
            return None
        total = 0.0
        inside = [t for t in self.ticks if t.time >= base.time]
        for a, b in itertools.pairwise(inside):
            total += a.replicas * (b.time - a.time)
        return total

    def spent(self, window_s: float) -> tuple[float, float] | None:
        """(∫ cost per hour dt, the seconds it covers) over the window; None without an interval or a cost."""
        base = self._base(window_s)
        if base is None:
            return None
        inside = [t for t in self.ticks if t.time >= base.time]
        if any(t.cost_per_hour is None for t in inside[:-1]):
            return None
        total = sum((a.cost_per_hour or 0.0) * (b.time - a.time) for a, b in itertools.pairwise(inside))
        return total / 3600.0, inside[-1].time - inside[0].time

    def replica_seconds_per_1k_good(self, window_s: float) -> float | None:
        counted = self.counted(window_s)
        seconds = self.replica_seconds(window_s)
        if counted is None or seconds is None or counted[0] <= 0:
            return None
        return seconds / (counted[0] / 1000)
