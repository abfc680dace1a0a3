"""Saturation knees of a concurrency sweep and the per-replica recommendation.

What it is: pure functions over the *valid* levels of a sweep.

- Throughput knee: the smallest concurrency whose output-token throughput reaches
  ``alpha`` (0.9) of the best; none when that is the largest tested level (the
  curve is still rising). Cross-checked by Kneedle on an evenly resampled grid —
  never on raw, log-spaced levels, where its x-blind flip finds false knees.
- Latency knee: where the worst latency margin crosses zero over the SLOs (or,
  without SLOs, TTFT p95 ≤ 3× and TPOT p50 ≤ 2× of the lowest level); the rule is
  :func:`plimsoll.capacity.latency_crossing`, shared with the operator.
- Recommendation: ⌊headroom × min(knees)⌋, :func:`plimsoll.capacity.recommend`.

What it is not: I/O or statistics; invalid levels never get here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from plimsoll.bench.config import SLO
from plimsoll.capacity import Recommendation, latency_crossing
from plimsoll.capacity import recommend as shared_recommend

TTFT_INFLATION = 3.0
TPOT_INFLATION = 2.0


@dataclass(frozen=True, slots=True)
class ThroughputKnee:
    concurrency: int | None
    best_output_tokens_per_s: float | None
    alpha: float
    kneedle_concurrency: float | None
    reason: str


@dataclass(frozen=True, slots=True)
class LatencyKnee:
    concurrency: float | None
    status: str  # "found" | "none" | "below_range" | "no_data"
    basis: str  # "slo" | "inflation_vs_lowest_level"
    binding: str | None
    margins: list[dict[str, Any]]
    reason: str


def kneedle(x: list[float], y: list[float], sensitivity: float = 1.0, grid: int = 256) -> float | None:
    """Kneedle (Satopää et al. 2011) for a concave, increasing curve, offline (first knee).

    The points are first resampled by linear interpolation onto ``grid`` evenly
    spaced x values, so spacing of the measured levels cannot bias the result.
    Returns None for curves within 5% of a straight line or without a knee.
    """
    if len(x) < 3:
        return None
    xs = np.linspace(min(x), max(x), grid)
    ys = np.interp(xs, x, y)
    span_y = ys.max() - ys.min()
    if span_y <= 0:
        return None
    xn = (xs - xs[0]) / (xs[-1] - xs[0])
    yn = (ys - ys.min()) / span_y
    diff = yn - xn
    if diff.max() < 0.05:
        return None
    threshold_step = sensitivity * float(np.mean(np.diff(xn)))
    maxima = [i for i in range(1, grid - 1) if diff[i] >= diff[i - 1] and diff[i] > diff[i + 1]]
    for j, i in enumerate(maxima):
        stop = maxima[j + 1] if j + 1 < len(maxima) else grid
        # A knee: the difference curve drops below the threshold before the next local max.
        if np.any(diff[i + 1 : stop] < diff[i] - threshold_step):
            return float(xs[i])
    return None


def throughput_knee(points: list[tuple[int, float]], alpha: float = 0.9) -> ThroughputKnee:
    """``points`` are (concurrency, output tokens/s) of valid levels, any order."""
    if not points:
        return ThroughputKnee(None, None, alpha, None, "no valid level")
    points = sorted(points)
    cs = [c for c, _ in points]
    xs = [x for _, x in points]
    best = max(xs)
    c_thr = next(c for c, x in points if x >= alpha * best)
    knee = kneedle([float(c) for c in cs], xs)
    if c_thr == cs[-1]:
        return ThroughputKnee(
            None,
            best,
            alpha,
            knee,
            f"no knee within the tested range: throughput still rising at c={cs[-1]}; extend --levels",
        )
    return ThroughputKnee(
        c_thr,
        best,
        alpha,
        knee,
        f"c={c_thr} is the smallest level reaching {alpha:.0%} of the best {best:.1f} tok/s",
    )


def _limits(levels: list[dict[str, Any]], slo: SLO) -> tuple[str, dict[str, tuple[str, str, float]]]:
    """metric name -> (latency key, percentile key, limit ms)."""
    if slo.is_set():
        limits = {}
        if slo.ttft_p95_ms is not None:
            limits["ttft_p95"] = ("ttft", "p95", slo.ttft_p95_ms)
        if slo.tpot_p50_ms is not None:
            limits["tpot_p50"] = ("tpot", "p50", slo.tpot_p50_ms)
        if slo.e2e_p95_ms is not None:
            limits["e2e_p95"] = ("e2e", "p95", slo.e2e_p95_ms)
        return "slo", limits
    base = levels[0]["latency_ms"]
    limits = {}
    if base.get("ttft"):
        limits["ttft_p95"] = ("ttft", "p95", TTFT_INFLATION * base["ttft"]["p95"])
    if base.get("tpot"):
        limits["tpot_p50"] = ("tpot", "p50", TPOT_INFLATION * base["tpot"]["p50"])
    return "inflation_vs_lowest_level", limits


def latency_knee(levels: list[dict[str, Any]], slo: SLO) -> LatencyKnee:
    """``levels`` are valid closed-loop level dicts (from stats.summarize_level)."""
    levels = sorted(levels, key=lambda lv: lv["concurrency"])
    if not levels:
        return LatencyKnee(
            None,
            "no_data",
            "slo" if slo.is_set() else "inflation_vs_lowest_level",
            None,
            [],
            "no valid level",
        )
    basis, limits = _limits(levels, slo)
    if not limits:
        return LatencyKnee(None, "no_data", basis, None, [], "no latency data at the lowest level")
    observed = [
        (
            lv["concurrency"],
            {
                name: None if lv["latency_ms"].get(metric) is None else lv["latency_ms"][metric][pct]
                for name, (metric, pct, _) in limits.items()
            },
        )
        for lv in levels
    ]
    crossing = latency_crossing(observed, {name: limit for name, (_, _, limit) in limits.items()})
    note = (
        ""
        if basis == "slo"
        else f" (limits: TTFT p95 ≤ {TTFT_INFLATION:g}×, TPOT p50 ≤ {TPOT_INFLATION:g}× of c={levels[0]['concurrency']})"
    )
    if crossing.status == "none":
        reason = (
            f"no knee within the tested range: every level up to c={levels[-1]['concurrency']} "
            f"meets the latency limits{note}"
        )
    elif crossing.status == "below_range":
        reason = (
            f"the lowest level c={levels[0]['concurrency']} already misses {crossing.binding}; "
            "lower the load or relax the SLO"
        )
    else:
        reason = (
            f"{crossing.binding} margin crosses zero between c={crossing.last_pass:g} and "
            f"c={crossing.first_fail:g} (interpolated in log2 c){note}"
        )
    return LatencyKnee(
        crossing.concurrency, crossing.status, basis, crossing.binding, crossing.margins, reason
    )


def recommend(thr: ThroughputKnee, lat: LatencyKnee, headroom: float) -> Recommendation:
    """The shared rule (:func:`plimsoll.capacity.recommend`); none when even the lowest level misses latency."""
    if lat.status == "below_range":
        return Recommendation(None, headroom, "latency", None, f"no safe concurrency: {lat.reason}")
    return shared_recommend({"throughput": thr.concurrency, "latency": lat.concurrency}, headroom)


def as_dict(obj: ThroughputKnee | LatencyKnee | Recommendation) -> dict[str, Any]:
    return asdict(obj)
