"""Scenario recipes from the seed articles, on top of a :class:`BenchSession`.

What it is: open-loop rate levels; the single-request baseline with its
TPOT-stability check; a burst on steady load with the recovery time; a soak that
records latency and the server's KV usage, resident memory, open file descriptors and
HTTP connections per window and flags any monotone upward trend (a least-squares slope
significant at 95 % that Kendall's test calls monotone, ``trend.py``) as well as a
first-to-last-third rise. Mixed input lengths and random ``max_tokens`` are the length
distributions of the config (``--input-tokens choice:64,512,2048``,
``--output-tokens uniform:16:256``) and work with every recipe.
What it is not: knee finding — only `sweep` yields knees.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from plimsoll.bench.loadgen import Arrival, arrival_offsets
from plimsoll.bench.session import BenchSession, LevelStart
from plimsoll.bench.stats import summarize_level, tpot_variation
from plimsoll.bench.trend import fit_trend, is_upward

TPOT_STABILITY_LIMIT = 0.20  # coefficient of variation of per-request TPOT
RECOVERY_FACTOR = 1.5  # TTFT within this factor of the pre-burst median counts as recovered
DRIFT_LIMIT = 0.20  # last third vs first third of a soak
# Series that are fractions of a whole must also rise by this much of the whole to drift: a
# near-empty KV cache going from 0.2 % to 0.3 % used is a 50 % rise and no leak at all.
DRIFT_MIN_ABSOLUTE = {"kv_usage_mean": 0.05}
# The smallest rise over a soak that a significant trend must also reach to be flagged: memory
# that grows 2 % an hour is a leak; latency that grows 5 % is worth a look.
TREND_MIN_RISE = {
    "ttft_p95": 0.05,
    "tpot_p50": 0.05,
    "e2e_p95": 0.05,
    "kv_usage_mean": 0.05,
    "resident_memory_mean": 0.02,
    "open_fds_mean": 0.05,
    "http_connections_mean": 0.05,
}
# The first window warms caches, pools and allocators; a trend is fitted from the second on
# (when at least this many windows remain).
TREND_SKIP_FIRST_FROM = 5


async def rate_levels(
    session: BenchSession,
    rates: list[float],
    arrival: str,
    burstiness: float,
    warmup_s: float,
    max_concurrency: int | None,
    on_start: LevelStart | None = None,
) -> dict[str, Any]:
    cfg = session.cfg
    duration = cfg.duration_per_level_s or 30.0
    levels = []
    kind = cast(Arrival, arrival)  # validated by the CLI
    for i, rate in enumerate(rates):
        offsets = arrival_offsets(rate, warmup_s + duration, kind, burstiness, cfg.seed + i)
        run = await session.schedule(
            offsets, (warmup_s, warmup_s + duration), rate, max_concurrency, on_start
        )
        lv = summarize_level([run], cfg)
        achieved = lv["throughput"]["requests_per_s"]
        lv["offered_rate"] = sum(1 for o in offsets if warmup_s <= o < warmup_s + duration) / duration
        lv["saturated"] = achieved < 0.9 * lv["offered_rate"]
        levels.append(lv)
    scenario = {
        "arrival": arrival,
        "burstiness": burstiness if arrival == "bursty" else None,
        "warmup_s": warmup_s,
        "max_concurrency": max_concurrency,
    }
    return session.report("rate", levels, scenario, knees=False)


async def run_baseline(session: BenchSession, on_start: LevelStart | None = None) -> dict[str, Any]:
    """Concurrency 1: the reference every latency-inflation limit is relative to."""
    lv = await session.level(1, on_start)
    measured = [r for run in session.runs for r in run.measured]
    variation = tpot_variation(measured)
    stable = variation is not None and variation <= TPOT_STABILITY_LIMIT
    if variation is None:
        session.warnings.append("TPOT stability not checked: fewer than two multi-token answers")
    elif not stable:
        session.warnings.append(
            f"unstable baseline: per-request TPOT varies by {variation:.0%} (coefficient of "
            f"variation > {TPOT_STABILITY_LIMIT:.0%}); fix the server's noise before sweeping"
        )
    scenario = {"tpot_variation": variation, "tpot_stable": stable, "limit": TPOT_STABILITY_LIMIT}
    return session.report("baseline", [lv], scenario, knees=False)


async def run_burst(
    session: BenchSession,
    steady_rate: float,
    burst_requests: int,
    before_s: float,
    after_s: float,
    on_start: LevelStart | None = None,
) -> dict[str, Any]:
    cfg = session.cfg
    steady = arrival_offsets(steady_rate, before_s + after_s, "constant", seed=cfg.seed)
    plan = sorted(
        [(o, False) for o in steady] + [(before_s, True)] * burst_requests, key=lambda p: (p[0], p[1])
    )
    run = await session.schedule([o for o, _ in plan], (0.0, before_s + after_s), steady_rate, None, on_start)
    lv = summarize_level([run], cfg)
    pairs = list(zip(plan, run.records, strict=True))
    pre = [r.ttft for (o, b), r in pairs if not b and o < before_s and r.ttft is not None]
    post = [(o, r.ttft) for (o, b), r in pairs if not b and o >= before_s]
    burst_ttfts = [r.ttft for (_, b), r in pairs if b and r.ttft is not None]
    base = statistics.median(pre) if pre else None
    recovery_s = None
    if base is not None:
        limit = RECOVERY_FACTOR * base
        # recovered at the first steady request after which every one stays within the limit
        for i, (o, _) in enumerate(post):
            if all(t is not None and t <= limit for _, t in post[i:]):
                recovery_s = o - before_s
                break
    if recovery_s is None:
        session.warnings.append(f"latency did not recover within {after_s:g} s after the burst")
    scenario = {
        "steady_rate": steady_rate,
        "burst_requests": burst_requests,
        "burst_at_s": before_s,
        "baseline_ttft_p50_ms": None if base is None else base * 1e3,
        "burst_ttft_max_ms": max(burst_ttfts) * 1e3 if burst_ttfts else None,
        "recovery_s": recovery_s,
        "recovered": recovery_s is not None,
        "recovery_factor": RECOVERY_FACTOR,
    }
    return session.report("burst", [lv], scenario, knees=False)


def _drift(values: list[float | None], min_absolute: float = 0.0) -> float | None:
    """Relative change from the first third to the last third of the windows; 0 when the
    absolute change is under ``min_absolute``."""
    xs = [v for v in values if v is not None]
    if len(xs) < 3:
        return None
    third = max(1, len(xs) // 3)
    head, tail = statistics.fmean(xs[:third]), statistics.fmean(xs[-third:])
    if head <= 0:
        return None
    return (tail - head) / head if tail - head >= min_absolute else 0.0


def _no_drift_data(name: str, windows: int) -> str:
    """Why a drift check could not run, and what would let it."""
    if windows < 3:
        fix = f"only {windows} window(s); raise --duration or lower --window for at least 3 (4 for a trend)"
    elif name == "resident_memory_mean":
        fix = "the server exposes no process_resident_memory_bytes on /metrics"
    elif name == "open_fds_mean":
        fix = "the server exposes no process_open_fds on /metrics"
    elif name == "http_connections_mean":
        fix = "the server exposes no plimsoll_http_connections on /metrics (vLLM has none)"
    elif name == "kv_usage_mean":
        fix = "the server exposes no KV-cache usage gauge on /metrics (or it stayed at 0)"
    else:
        fix = "fewer than 3 windows produced this latency (or its first third was 0)"
    return f"drift check {name} has no data: {fix}"


@dataclass(frozen=True, slots=True)
class Windows:
    """Steady load recorded window by window: ``concurrency`` clients for ``duration_s``, a level each ``window_s``."""

    concurrency: int
    duration_s: float
    window_s: float

    @property
    def count(self) -> int:
        return max(1, round(self.duration_s / self.window_s))


async def windowed_levels(
    sessions: Sequence[tuple[dict[str, Any], BenchSession]],
    windows: Windows,
    on_start: LevelStart | None = None,
) -> list[list[dict[str, Any]]]:
    """``windows`` on each session in turn, window by window; each session's levels, carrying its
    fields and ``window_index``."""
    recorded: list[list[dict[str, Any]]] = [[] for _ in sessions]
    for i in range(windows.count):
        for (fields, session), levels in zip(sessions, recorded, strict=True):
            lv = await session.level(windows.concurrency, on_start)
            lv.update(fields, window_index=i)
            levels.append(lv)
    return recorded


async def run_soak(
    session: BenchSession, soak: Windows, on_start: LevelStart | None = None
) -> dict[str, Any]:
    [levels] = await windowed_levels([({}, session)], soak, on_start)
    windows, window_s = soak.count, soak.window_s

    def series(metric: str, pct: str) -> list[float | None]:
        return [lv["latency_ms"][metric][pct] if lv["latency_ms"][metric] else None for lv in levels]

    def server(name: str) -> list[float | None]:
        return [(lv["server"] or {}).get(name, {}) and lv["server"][name]["mean"] for lv in levels]

    series_by_name = {
        "ttft_p95": series("ttft", "p95"),
        "tpot_p50": series("tpot", "p50"),
        "e2e_p95": series("e2e", "p95"),
        "kv_usage_mean": server("kv_usage"),
        "resident_memory_mean": server("resident_memory_bytes"),
        "open_fds_mean": server("open_fds"),
        "http_connections_mean": server("http_connections"),
    }
    drift = {
        name: _drift(values, DRIFT_MIN_ABSOLUTE.get(name, 0.0)) for name, values in series_by_name.items()
    }
    times = [(i + 0.5) * window_s for i in range(windows)]
    skip = 1 if windows >= TREND_SKIP_FIRST_FROM else 0
    trend: dict[str, dict[str, Any] | None] = {}
    rising = []
    for name, values in series_by_name.items():
        fit = fit_trend(times[skip:], values[skip:])
        trend[name] = None if fit is None else {**fit.as_dict(), "min_rise": TREND_MIN_RISE[name]}
        span = times[-1] - times[skip]
        absolute_rise = 0.0 if fit is None else fit.slope_per_s * span
        if is_upward(fit, TREND_MIN_RISE[name]) and absolute_rise >= DRIFT_MIN_ABSOLUTE.get(name, 0.0):
            rising.append(name)
            assert fit is not None
            lo, hi = fit.slope_ci95
            session.warnings.append(
                f"upward trend: {name} rises {fit.rise:.1%} over the soak, slope {fit.slope_per_s * 3600:.4g}/h "
                f"(95% CI {lo * 3600:.4g} to {hi * 3600:.4g}/h, p={fit.p_value:.2g}; Kendall tau "
                f"{fit.kendall_tau:.2f}, p={fit.kendall_p:.2g})"
            )
    drifting = sorted(k for k, v in drift.items() if v is not None and v > DRIFT_LIMIT)
    flagged = sorted(set(drifting) | set(rising))
    unchecked = sorted(k for k in series_by_name if drift[k] is None and trend[k] is None)
    for name in unchecked:
        session.warnings.append(_no_drift_data(name, windows))
    for name in drifting:
        session.warnings.append(
            f"upward drift: {name} rose {drift[name]:.0%} from the first to the last third"
        )
    scenario = {
        "windows": windows,
        "window_s": window_s,
        "drift": drift,
        "drift_limit": DRIFT_LIMIT,
        "trend": trend,
        "trend_from_window": skip,
        "rising": sorted(rising),
        "drifting": flagged,
        "unchecked": unchecked,
    }
    return session.report("soak", levels, scenario, knees=False)
