"""Profile drift: does each replica still behave like the curve its profile measured?

What it is: :class:`DriftTracker`, fed one scrape per ready replica every
replica-planning tick. Every tick it compares what each replica did over the last
*slice* (``window / SLICES`` seconds, with at least ``min_requests`` finished
requests) with the profile's curve at the in-flight level it held (the mean of
the running + waiting gauges over the slice, interpolated between the sweep's
levels):

- output tokens per second (``generation_tokens`` counter delta ÷ seconds);
- TTFT p95 and TPOT p50 (bucket deltas, ``histogram_quantile``).

A replica drifts when any of them is off by more than ``margin`` (relative to
the profile's figure, either way: slower and faster both mean the line was
measured on something else), or when the engine version it reports changed
since the profile's first observation. "For a window" means every comparison
with enough traffic over the last ``window`` seconds was off: one within the
margin starts the count again, so a burst shorter than the window (a p95 is
dominated by its tail) never raises it. :meth:`DriftTracker.verdict` turns that
into the ``ProfileDrift`` condition with the numbers in its message.

What it is not: the loop that scrapes, writes the condition and posts the
Event (``operator/handlers/drift.py``, run by the replica-planning tick), or
the re-profile itself (the profiler starts a Job when the
``plimsoll.dev/reprofile`` annotation is set).
Comparing over the whole window rather than each tick makes "differs for a
window" a statement about the window's aggregate: short spikes inside an
otherwise matching window do not raise it. No I/O.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.api.base import camel_fields, camel_values
from plimsoll.operator.api.spec import DriftSpec
from plimsoll.operator.scaling.formula import fmt
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.prometheus import Histogram, histogram_quantile

# The tracker's defaults are spec.capacity.drift's, so the two cannot disagree. Its min_requests:
# a p95 over fewer finished requests is noise; so is a throughput over an idle replica.
_SPEC_DEFAULTS = DriftSpec()
# Comparisons per window: each covers window / SLICES seconds.
SLICES = 5


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One closed-loop level of the profile: what one replica did at ``concurrency`` in flight."""

    concurrency: float
    output_tokens_per_s: float | None
    ttft_p95_ms: float | None
    tpot_p50_ms: float | None

    def to_status(self) -> dict[str, Any]:
        """One entry of ``status.capacity.curve`` (what :meth:`from_status` reads back)."""
        return camel_fields(self)

    @classmethod
    def from_status(cls, item: Mapping[str, Any]) -> CurvePoint:
        """The point :meth:`to_status` wrote; its concurrency must be there, the figures may be missing."""
        return cls(**{**camel_values(cls, item), "concurrency": float(item["concurrency"])})


def _quantile_ms(q: float, h: Histogram) -> tuple[float, float, float] | None:
    """(estimate, bucket low, bucket high) of the q-quantile in ms; the +Inf bucket has no high."""
    estimate = histogram_quantile(q, h)
    if estimate is None:
        return None
    rank = q * h.count
    low = 0.0
    for le, cumulative in h.buckets:
        if cumulative >= rank:
            return estimate * 1000, low * 1000, le * 1000
        low = le
    return estimate * 1000, low * 1000, math.inf


def curve_from_status(capacity: Mapping[str, Any] | None) -> tuple[CurvePoint, ...]:
    """``status.capacity.curve`` as points sorted by concurrency; empty when none was recorded."""
    items = (capacity or {}).get("curve") or []
    return tuple(sorted((CurvePoint.from_status(i) for i in items), key=lambda p: p.concurrency))


def expected_at(curve: Sequence[CurvePoint], in_flight: float, pick: str) -> float | None:
    """The profile's ``pick`` figure at ``in_flight``, linear between levels, clamped at the ends."""
    points = [(p.concurrency, getattr(p, pick)) for p in curve if getattr(p, pick) is not None]
    if not points:
        return None
    if in_flight <= points[0][0]:
        return float(points[0][1])
    for (c0, v0), (c1, v1) in itertools.pairwise(points):
        if c0 <= in_flight <= c1:
            return float(v0 + (v1 - v0) * (in_flight - c0) / (c1 - c0))
    return float(points[-1][1])


@dataclass(frozen=True, slots=True)
class Comparison:
    """One replica over one window: live against the profile, by metric."""

    pod: str
    in_flight: float
    requests: float
    seconds: float
    # metric -> (live, expected, low, high): low..high is what the live figure can be (its histogram
    # bucket for a quantile; the figure itself for a counter rate). Only metrics both sides have.
    figures: dict[str, tuple[float, float, float, float]]
    margin: float

    def off(self) -> dict[str, float]:
        """Metrics off by more than the margin -> relative difference (live − expected) ÷ expected.

        A quantile read from a histogram is only known to its bucket: it counts as
        off only when the whole bucket is further than the margin from the
        profile's figure, so bucket interpolation alone never raises drift.
        """
        out = {}
        for name, (_, expected, low, high) in self.figures.items():
            if expected <= 0:
                continue
            gap = (low - expected) if expected < low else (high - expected) if expected > high else 0.0
            if abs(gap) / expected > self.margin:
                out[name] = gap / expected
        return out

    def sentence(self) -> str:
        parts = []
        for name, (live, expected, low, high) in self.figures.items():
            if expected <= 0:
                continue
            known = "" if low == high else f" (bucket {fmt(low)}..{fmt(high)})"
            parts.append(
                f"{name} {fmt(live)}{known} vs profile {fmt(expected)} ({(live - expected) / expected:+.0%})"
            )
        return (
            f"pod {self.pod} at {fmt(self.in_flight)} in flight over {fmt(self.seconds)} s "
            f"({fmt(self.requests)} requests): " + ", ".join(parts)
        )


@dataclass(frozen=True, slots=True)
class DriftVerdict:
    """The ``ProfileDrift`` condition's content (``status`` None: not enough seen to say anything new)."""

    status: str | None  # "True", "False", "Unknown" or None (keep what is there)
    reason: str
    message: str
    drifted: tuple[Comparison, ...] = ()
    version_change: tuple[str, str, str] | None = None  # (pod, was, now)


@dataclass
class DriftTracker:
    """Per-replica scrape history for one LLMService, reset whenever a new profile is recorded."""

    curve: tuple[CurvePoint, ...]
    margin: float = _SPEC_DEFAULTS.margin
    window_s: float = float(_SPEC_DEFAULTS.window_seconds)
    min_requests: float = _SPEC_DEFAULTS.min_requests
    # What the profile was measured on, to notice a new one (status.capacity.measuredAt).
    profile_id: str | None = None
    history: dict[str, deque[tuple[float, PodSample]]] = field(default_factory=dict)
    # Per pod: when the comparisons began to be continuously off, and the latest comparison.
    off_since: dict[str, float] = field(default_factory=dict)
    latest: dict[str, Comparison] = field(default_factory=dict)
    # The engine version first seen under this profile (the profile Job measured a replica of it).
    version: str | None = None
    version_change: tuple[str, str, str] | None = None

    def observe(self, now: float, samples: Mapping[str, PodSample]) -> None:
        """Record one tick's scrapes; pods gone from the tick are forgotten."""
        for table in (self.history, self.off_since, self.latest):
            for name in [n for n in table if n not in samples]:
                del table[name]
        span = self.slice_s
        for name, sample in samples.items():
            kept = self.history.setdefault(name, deque())
            kept.append((now, sample))
            # Keep one scrape at or before the slice's start, so the slice is spanned exactly.
            while len(kept) >= 2 and kept[1][0] <= now - span:
                kept.popleft()
            comparison = self.compare(name)
            if comparison is not None:
                self.latest[name] = comparison
                if not comparison.off():
                    self.off_since.pop(name, None)
                else:
                    # The first off comparison already covers the slice before it.
                    self.off_since.setdefault(name, now - comparison.seconds)
            version = sample.engine_version
            if version is None:
                continue
            if self.version is None:
                self.version = version
            elif version != self.version and self.version_change is None:
                self.version_change = (name, self.version, version)

    @property
    def slice_s(self) -> float:
        return self.window_s / SLICES

    def drifting(self, pod: str, now: float) -> bool:
        """Every comparison of ``pod`` over the last window was off by more than the margin."""
        since = self.off_since.get(pod)
        return since is not None and now - since >= self.window_s

    def compare(self, pod: str) -> Comparison | None:
        """The pod over the last full slice; None until a slice is spanned with enough traffic."""
        kept = self.history.get(pod)
        if not kept or len(kept) < 2:
            return None
        (t0, first), (t1, last) = kept[0], kept[-1]
        seconds = t1 - t0
        if seconds < self.slice_s:
            return None
        ttft = last.ttft.delta(first.ttft) if last.ttft is not None else None
        requests = ttft.count if ttft is not None else 0.0
        if requests < self.min_requests:
            return None
        in_flight = sum(s.in_flight for _, s in kept) / len(kept)
        live: dict[str, tuple[float, float, float] | None] = {}
        if ttft is not None:
            live["TTFT p95 ms"] = _quantile_ms(0.95, ttft)
        if last.tpot is not None:
            live["TPOT p50 ms"] = _quantile_ms(0.50, last.tpot.delta(first.tpot))
        if last.generation_tokens is not None and first.generation_tokens is not None:
            produced = last.generation_tokens - first.generation_tokens
            if produced >= 0:  # a restarted engine resets the counter: no figure this window
                rate = produced / seconds
                live["output tokens/s"] = (rate, rate, rate)
        picks = {
            "TTFT p95 ms": "ttft_p95_ms",
            "TPOT p50 ms": "tpot_p50_ms",
            "output tokens/s": "output_tokens_per_s",
        }
        figures = {}
        for name, known in live.items():
            expected = expected_at(self.curve, in_flight, picks[name])
            if known is not None and expected is not None:
                figures[name] = (known[0], expected, known[1], known[2])
        return Comparison(pod, in_flight, requests, seconds, figures, self.margin)

    def verdict(self, now: float) -> DriftVerdict:
        """ProfileDrift for the replicas as seen at ``now`` (the last :meth:`observe`)."""
        if self.version_change is not None:
            pod, was, running = self.version_change
            return DriftVerdict(
                "True", "EngineVersionChanged",
                f"pod {pod} reports engine version {running}; the profile was measured on {was}",
                version_change=self.version_change,
            )  # fmt: skip
        if not self.curve:
            return DriftVerdict(
                "Unknown", "NoProfileCurve", "the recorded profile has no per-level curve to compare with"
            )
        comparisons = [self.latest[p] for p in sorted(self.latest)]
        drifted = tuple(c for c in comparisons if self.drifting(c.pod, now))
        if drifted:
            return DriftVerdict(
                "True", "BehaviourChanged",
                f"{len(drifted)} of {len(comparisons)} replicas differ from the profile by more than "
                f"{self.margin:.0%} for {fmt(self.window_s)} s: "
                + "; ".join(c.sentence() for c in drifted),
                drifted=drifted,
            )  # fmt: skip
        matching = [c for c in comparisons if not c.off()]
        if not matching:
            return DriftVerdict(
                None, "NotEnoughTraffic", ""
            )  # nothing compared yet, or off for less than a window
        return DriftVerdict(
            "False", "MatchesProfile",
            f"{len(matching)} of {len(comparisons)} replicas within margin {self.margin:.0%}: "
            + "; ".join(c.sentence() for c in matching),
        )  # fmt: skip
