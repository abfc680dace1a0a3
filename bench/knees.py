"""Saturation knees of a concurrency sweep and the per-replica recommendation.

What it is: pure functions over the *valid* levels of a sweep.

- Throughput knee: the smallest concurrency whose output-token throughput reaches
  ``alpha`` (0.9) of the best; none when that is the largest tested level (the
  curve is still rising). Cross-checked by Kneedle on an evenly resampled grid —
  never on raw, log-spaced levels, where its x-blind flip finds false knees.
- Latency knee with SLOs: where the worst SLO margin crosses zero (the largest
  concurrency whose levels all meet every SLO, interpolated), by
  :func:`plimsoll.capacity.latency_crossing`, shared with the operator.
- Latency knee without SLOs: where queueing begins — the first level at which the
  server's own histograms show requests waiting, placed at the batch the server
  held there — or, if lower, where client latency inflates (TTFT p95 past 3× and
  +100 ms, TPOT p50 past 2× and +10 ms of the lowest undisturbed level) at a
  level the server did not see queue (inflation first seen at a queueing level is
  that queue, and the server's figure places it).
- Confidence: requests per level, spread between repeats, disturbed levels near the knee.
- Recommendation: ⌊headroom × min(knees)⌋, :func:`plimsoll.capacity.recommend`.

What it is not: I/O or statistics; invalid levels never get here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from plimsoll.bench.config import SLO
from plimsoll.capacity import Recommendation, latency_crossing
from plimsoll.capacity import recommend as shared_recommend

TTFT_INFLATION = 3.0
TPOT_INFLATION = 2.0
# Absolute floors under the relative rules (docs/bench.md): inflation counts only this far above the base.
TTFT_FLOOR_MS = 100.0
TPOT_FLOOR_MS = 10.0
# A level queues when requests wait longer than this many server steps, and longer than the floor.
QUEUE_STEPS = 1.0
QUEUE_FLOOR_MS = 5.0


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
    basis: str  # "slo" | "queueing_and_inflation" | "inflation_vs_lowest_level" (no server metrics)
    binding: str | None  # "queueing", or the latency limit that failed first
    margins: list[dict[str, Any]]
    reason: str
    limits_ms: dict[str, float] = field(default_factory=dict)


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


def inflation_limits(base: dict[str, Any]) -> dict[str, tuple[str, str, float]]:
    """Latency limits (metric name -> (latency key, percentile key, limit ms)) relative to ``base``.

    Relative rules with absolute floors: TTFT p95 counts as inflated only above
    both 3× and +100 ms of the base level, TPOT p50 above both 2× and +10 ms, so
    a few milliseconds of client or network jitter on a fast server is not a knee.
    """
    limits = {}
    if base["latency_ms"].get("ttft"):
        ttft = base["latency_ms"]["ttft"]["p95"]
        limits["ttft_p95"] = ("ttft", "p95", max(TTFT_INFLATION * ttft, ttft + TTFT_FLOOR_MS))
    if base["latency_ms"].get("tpot"):
        tpot = base["latency_ms"]["tpot"]["p50"]
        limits["tpot_p50"] = ("tpot", "p50", max(TPOT_INFLATION * tpot, tpot + TPOT_FLOOR_MS))
    return limits


def _slo_limits(slo: SLO) -> dict[str, tuple[str, str, float]]:
    limits = {}
    if slo.ttft_p95_ms is not None:
        limits["ttft_p95"] = ("ttft", "p95", slo.ttft_p95_ms)
    if slo.tpot_p50_ms is not None:
        limits["tpot_p50"] = ("tpot", "p50", slo.tpot_p50_ms)
    if slo.e2e_p95_ms is not None:
        limits["e2e_p95"] = ("e2e", "p95", slo.e2e_p95_ms)
    return limits


def is_disturbed(level: dict[str, Any]) -> bool:
    return bool((level.get("disturbed") or {}).get("reasons"))


def queueing(level: dict[str, Any], host_ms: float = 0.0) -> bool | None:
    """Whether requests waited at this level, by the server's own histograms; None without them.

    A level queues when the mean queue time exceeds, beyond ``host_ms`` (the host's own scheduling
    delay, :func:`host_delay_ms`), both ``QUEUE_STEPS`` of the server's step time (a request may
    wait for the next step boundary) and ``QUEUE_FLOOR_MS``. One client never queues: its request
    has no other to wait behind.
    """
    load = (level.get("server") or {}).get("load") or {}
    queue_ms = load.get("queue_time_mean_ms")
    if queue_ms is None:
        return None
    if level.get("concurrency") == 1:
        return False
    return bool(queue_ms - host_ms > max(QUEUE_FLOOR_MS, QUEUE_STEPS * (load.get("step_time_ms") or 0.0)))


def host_delay_ms(levels: list[dict[str, Any]]) -> float:
    """The queue time of a one-client level: nothing to wait behind there, so what it shows is the host
    scheduling the engine (a busy CPU's delay), which every level carries; 0 without such a level."""
    one = next((lv for lv in levels if lv.get("concurrency") == 1), None)
    load = ((one or {}).get("server") or {}).get("load") or {}
    return max(0.0, float(load.get("queue_time_mean_ms") or 0.0))


def _held_batch(level: dict[str, Any]) -> float | None:
    load = (level.get("server") or {}).get("load") or {}
    value = load.get("batch_mean") or load.get("running_mean")
    return None if value is None else float(value)


def _at(levels: list[dict[str, Any]], concurrency: float | None) -> dict[str, Any]:
    return next((lv for lv in levels if lv["concurrency"] == concurrency), {})


def _queueing_knee(levels: list[dict[str, Any]], host: float) -> tuple[str, float | None, str] | None:
    """(status, concurrency, reason) of where queueing begins, or None when no level has server data."""
    flags = [(lv["concurrency"], queueing(lv, host), lv) for lv in levels]
    if any(q is None for _, q, _ in flags):
        return None
    first = next((i for i, (_, q, _) in enumerate(flags) if q), None)
    if first is None:
        return "none", None, f"no level up to c={levels[-1]['concurrency']} queued at the server"
    c_fail, _, lv_fail = flags[first]
    load = lv_fail["server"]["load"]
    if first == 0:
        return (
            "below_range",
            None,
            f"requests already waited at the lowest level c={c_fail} (mean queue time "
            f"{load['queue_time_mean_ms']:.0f} ms); lower the load or check the server's batch limits",
        )
    c_pass = flags[first - 1][0]
    held = _held_batch(lv_fail)
    # The server holds its batch cap at the first queueing level: that is where more concurrency
    # starts to wait. It lies between the last level that did not queue and the first that did.
    knee = float(c_pass) if held is None else min(max(held, float(c_pass)), float(c_fail))
    return (
        "found",
        round(knee, 2),
        f"queueing begins between c={c_pass} and c={c_fail}: at c={c_fail} the server ran "
        f"{'?' if held is None else f'{held:.1f}'} requests while the rest waited (mean queue time "
        f"{load['queue_time_mean_ms']:.0f} ms against a {load.get('step_time_ms') or 0:.0f} ms step)",
    )


def latency_knee(levels: list[dict[str, Any]], slo: SLO) -> LatencyKnee:
    """``levels`` are valid closed-loop level dicts (from stats.summarize_level).

    With SLOs: where the worst SLO margin crosses zero. Without: the lower of where
    queueing begins at the server (its own histograms) and where client latency
    inflates past :func:`inflation_limits` of the lowest undisturbed level, judged
    on undisturbed levels only.
    """
    levels = sorted(levels, key=lambda lv: lv["concurrency"])
    basis = "slo" if slo.is_set() else "queueing_and_inflation"
    if not levels:
        return LatencyKnee(None, "no_data", basis, None, [], "no valid level")
    host = host_delay_ms(levels)
    queue = None if slo.is_set() else _queueing_knee(levels, host)
    # Client latencies of a disturbed level measure the host, not the server: they are left out where
    # undisturbed levels remain (or, without SLOs, where the server's own queueing is there to stand on).
    quiet = [lv for lv in levels if not is_disturbed(lv)]
    if slo.is_set():
        judged, limits = quiet or levels, _slo_limits(slo)
    else:
        judged = quiet if queue is not None else (quiet or levels)
        limits = inflation_limits(judged[0]) if judged else {}
    if not slo.is_set() and queue is None:
        basis = "inflation_vs_lowest_level"
    if not limits and queue is not None:
        q_status, q_knee, q_reason = queue
        return LatencyKnee(
            q_knee,
            q_status,
            basis,
            "queueing" if q_status != "none" else None,
            [{"concurrency": lv["concurrency"], "queueing": queueing(lv, host)} for lv in levels],
            f"{q_reason}; client latencies not judged: every level was disturbed",
        )
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
        for lv in judged
    ]
    crossing = latency_crossing(observed, {name: limit for name, (_, _, limit) in limits.items()})
    limits_ms = {name: round(limit, 3) for name, (_, _, limit) in limits.items()}
    note = (
        ""
        if slo.is_set()
        else (
            f" (limits: TTFT p95 ≤ max({TTFT_INFLATION:g}×, +{TTFT_FLOOR_MS:g} ms), TPOT p50 ≤ "
            f"max({TPOT_INFLATION:g}×, +{TPOT_FLOOR_MS:g} ms) of c={judged[0]['concurrency']})"
        )
    )
    if crossing.status == "none":
        status, knee, binding = "none", None, None
        reason = (
            f"no knee within the tested range: every level up to c={judged[-1]['concurrency']} "
            f"meets the latency limits{note}"
        )
    elif crossing.status == "below_range":
        status, knee, binding = "below_range", None, crossing.binding
        reason = (
            f"the lowest level c={judged[0]['concurrency']} already misses {crossing.binding}; "
            "lower the load or relax the SLO"
        )
    else:
        status, knee, binding = "found", crossing.concurrency, crossing.binding
        reason = (
            f"{crossing.binding} margin crosses zero between c={crossing.last_pass:g} and "
            f"c={crossing.first_fail:g} (interpolated in log2 c){note}"
        )
    if queue is not None:
        q_status, q_knee, q_reason = queue
        # Client inflation first seen at a level the server says queued is that queue, seen from
        # outside: the server's figure places it better than interpolating client latencies.
        explained = status == "found" and queueing(_at(levels, crossing.first_fail), host) is True
        if q_status == "below_range" or (
            q_status == "found" and status != "below_range" and (knee is None or explained or q_knee < knee)  # type: ignore[operator]
        ):
            client = reason
            status, knee, binding = q_status, q_knee, "queueing"
            reason = f"{q_reason}; client latencies: {client}"
        elif status == "none" and q_status == "none":
            reason = f"{reason}; {q_reason}"
        else:
            reason = f"{reason}; server: {q_reason}"
    margins = crossing.margins
    if queue is not None:
        flags = {lv["concurrency"]: queueing(lv, host) for lv in levels}
        margins = [{**m, "queueing": flags.get(m["concurrency"])} for m in margins]
    return LatencyKnee(knee, status, basis, binding, margins, reason, limits_ms)


def confidence(levels: list[dict[str, Any]], knee: float | None) -> dict[str, Any]:
    """How far to trust a knee: requests per level, spread between repeats, disturbed levels near it."""
    if not levels:
        return {"rating": "none", "note": "no valid level"}
    counts = [lv["requests"]["completed"] for lv in levels]
    spreads = []
    for lv in levels:
        thr = lv["throughput"]
        lo, hi, mid = (
            thr.get("output_tokens_per_s_min"),
            thr.get("output_tokens_per_s_max"),
            thr["output_tokens_per_s"],
        )
        if lv.get("repeats", 1) > 1 and lo is not None and hi is not None and mid > 0:
            spreads.append((hi - lo) / mid)
    spread = max(spreads) if spreads else None
    disturbed = [lv["concurrency"] for lv in levels if is_disturbed(lv)]
    near = [c for c in disturbed if knee is not None and knee / 2 <= c <= knee * 2]
    problems = []
    if min(counts) < 100:
        problems.append(f"as few as {min(counts)} requests a level (100 make a p99 mean something)")
    if spread is None:
        problems.append("one repeat a level, so no spread between repeats (use --repeats 3)")
    elif spread > 0.1:
        problems.append(f"throughput differs by up to {spread:.0%} between repeats")
    if near:
        problems.append(f"disturbed levels near the knee: {', '.join(f'c={c}' for c in near)}")
    rating = (
        "high" if not problems else ("low" if near or (spread or 0) > 0.1 or min(counts) < 20 else "medium")
    )
    return {
        "rating": rating,
        "requests_per_level_min": min(counts),
        "repeat_spread": spread,
        "disturbed_levels": disturbed,
        "note": "; ".join(problems)
        or f"{min(counts)}+ requests a level, repeats within 10%, no disturbed level",
    }


def recommend(thr: ThroughputKnee, lat: LatencyKnee, headroom: float) -> Recommendation:
    """The shared rule (:func:`plimsoll.capacity.recommend`); none when even the lowest level misses latency."""
    if lat.status == "below_range":
        return Recommendation(None, headroom, "latency", None, f"no safe concurrency: {lat.reason}")
    return shared_recommend({"throughput": thr.concurrency, "latency": lat.concurrency}, headroom)


def as_dict(obj: ThroughputKnee | LatencyKnee | Recommendation) -> dict[str, Any]:
    return asdict(obj)
