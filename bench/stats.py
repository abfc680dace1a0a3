"""Per-level statistics and validity gates, by the formulas in docs/bench.md.

What it is: pure functions from :class:`LevelRun` objects (repeats of one level) to
the level dict the JSON report carries: TTFT, TPOT = (E2E − TTFT)/(n − 1), ITL per
chunk gap and E2E percentiles; request and token throughput over the measurement
window; goodput and SLO attainment; errors by kind; achieved concurrency; client
lag; the gates that mark a level invalid. What it is not: knee finding.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from typing import Any

import numpy as np

from plimsoll.bench.client import RequestRecord
from plimsoll.bench.config import SLO, BenchConfig
from plimsoll.bench.loadgen import LevelRun

PERCENTILES = (50, 90, 95, 99)


def distribution_ms(values: list[float]) -> dict[str, float] | None:
    """mean and p50/p90/p95/p99 in milliseconds (linear interpolation), or None if empty."""
    if not values:
        return None
    arr = np.asarray(values) * 1e3
    out = {"mean": float(arr.mean())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    return out


def meets_slo(rec: RequestRecord, slo: SLO) -> bool:
    """A request is good when it succeeded and every configured per-request bound holds.

    SLOs are written as percentiles; per request each applies as a plain bound.
    """
    if not rec.ok:
        return False
    ttft, e2e, tpot = rec.ttft or 0.0, rec.e2e or 0.0, rec.tpot or 0.0
    return not (
        (slo.ttft_p95_ms is not None and ttft * 1e3 > slo.ttft_p95_ms)
        or (slo.tpot_p50_ms is not None and tpot * 1e3 > slo.tpot_p50_ms)
        or (slo.e2e_p95_ms is not None and e2e * 1e3 > slo.e2e_p95_ms)
    )


def achieved_concurrency(run: LevelRun) -> float:
    """Time-averaged requests in flight inside the window (from send to end)."""
    span = run.window_end - run.window_start
    if span <= 0:
        return 0.0
    busy = 0.0
    for r in run.records:
        end = r.end if r.end is not None else run.window_end
        busy += max(0.0, min(end, run.window_end) - max(r.sent, run.window_start))
    return busy / span


def window_throughput(run: LevelRun) -> dict[str, float]:
    """Rates inside the window: completions, and tokens by their chunk timestamps."""
    span = max(run.window_end - run.window_start, 1e-9)
    lo, hi = run.window_start, run.window_end
    done = [r for r in run.records if r.ok and r.end is not None and lo <= r.end < hi]
    out_tokens = 0.0
    for r in run.records:
        if not r.chunk_times:
            continue
        # Spread a request's usage count over its chunks (a chunk can carry several tokens).
        per_chunk = r.n_output / len(r.chunk_times)
        out_tokens += per_chunk * sum(1 for t in r.chunk_times if lo <= t < hi)
    in_tokens = sum((r.prompt_tokens or r.input_tokens_target) for r in done)
    return {
        "requests_per_s": len(done) / span,
        "output_tokens_per_s": out_tokens / span,
        "total_tokens_per_s": (out_tokens + in_tokens) / span,
    }


def summarize_level(runs: list[LevelRun], cfg: BenchConfig) -> dict[str, Any]:
    """The report's level entry for the repeats of one level."""
    measured = [r for run in runs for r in run.measured]
    ok = [r for r in measured if r.ok]
    failed = [r for r in measured if not r.ok]
    errors = Counter(r.error_kind or "unknown" for r in failed)
    examples = {kind: next(r.error_message for r in failed if r.error_kind == kind) for kind in errors}
    per_run = [window_throughput(run) for run in runs]
    thr = {k: statistics.median(p[k] for p in per_run) for k in per_run[0]}
    spans = [run.window_end - run.window_start for run in runs]
    good = [r for r in ok if meets_slo(r, cfg.slo)]
    target = runs[0].concurrency
    achieved = statistics.median(achieved_concurrency(run) for run in runs)
    lags = [x for run in runs for x in run.loop_lag]
    lag_p99_ms = float(np.percentile(lags, 99) * 1e3) if lags else 0.0
    send_lag = distribution_ms([r.send_lag for r in measured])
    error_rate = len(failed) / len(measured) if measured else 1.0
    reasons = []
    if not measured:
        reasons.append("no request was measured (window empty)")
    elif not ok:
        reasons.append("every measured request failed")
    if measured and error_rate > cfg.max_error_rate:
        reasons.append(f"error rate {error_rate:.1%} > {cfg.max_error_rate:.0%} ({dict(errors)})")
    # The closed-loop window runs from the first to the N-th measured send. With one request a
    # level (--requests-per-level 1 at c=1) it holds nothing to average concurrency over; the
    # cause is the count, not the server. (No completion inside a non-empty window is normal
    # when the count is near the concurrency: every worker is busy the whole window.)
    empty_window = bool(measured) and all(
        run.window_end <= run.window_start or achieved_concurrency(run) == 0.0 for run in runs
    )
    if empty_window and runs[0].rate is None:
        reasons.append(
            f"measurement window of its {len(measured)} request(s) held no request in flight (it closes at the last measured send); "
            "raise --requests-per-level (100 or more) or use --duration-per-level"
        )
    elif target is not None and runs[0].rate is None and achieved < cfg.min_concurrency_ratio * target:
        reasons.append(
            f"achieved concurrency {achieved:.2f} < {cfg.min_concurrency_ratio:.0%} of target {target}"
        )
    if lag_p99_ms > cfg.max_client_lag_ms:
        reasons.append(
            f"client overloaded: event-loop lag p99 {lag_p99_ms:.1f} ms > {cfg.max_client_lag_ms:g} ms"
        )
    level: dict[str, Any] = {
        "concurrency": target if runs[0].rate is None else None,
        "rate": runs[0].rate,
        "repeats": len(runs),
        "valid": not reasons,
        "invalid_reasons": reasons,
        "duration_s": float(sum(spans)),
        "requests": {
            "measured": len(measured),
            "completed": len(ok),
            "failed": len(failed),
            "error_rate": error_rate,
            "errors_by_kind": dict(errors),
            "error_examples": examples,
            "timeouts": errors.get("timeout", 0),
        },
        "achieved_concurrency": achieved,
        "concurrency_ratio": achieved / target if target else None,
        "throughput": {
            **thr,
            "output_tokens_per_s_min": min(p["output_tokens_per_s"] for p in per_run),
            "output_tokens_per_s_max": max(p["output_tokens_per_s"] for p in per_run),
            "goodput_requests_per_s": len(good) / max(sum(spans), 1e-9) if cfg.slo.is_set() else None,
        },
        "slo_attainment": (len(good) / len(ok) if ok else 0.0) if cfg.slo.is_set() else None,
        "latency_ms": {
            "ttft": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
            "tpot": distribution_ms([t for r in ok if (t := r.tpot) is not None]),
            "itl": distribution_ms([g for r in ok for g in r.itls()]),
            "e2e": distribution_ms([r.e2e for r in ok if r.e2e is not None]),
        },
        "tokens": {
            "prompt_mean": float(np.mean([r.prompt_tokens for r in ok if r.prompt_tokens is not None]))
            if any(r.prompt_tokens is not None for r in ok)
            else None,
            "output_mean": float(np.mean([r.n_output for r in ok])) if ok else None,
        },
        "client": {
            "send_lag_ms": send_lag,
            "loop_lag_p99_ms": lag_p99_ms,
            "overloaded": lag_p99_ms > cfg.max_client_lag_ms,
        },
        "server": runs[-1].server,
    }
    if cfg.models:
        level["by_model"] = {m: model_figures(runs, m) for m in cfg.models}
    return level


def model_figures(runs: list[LevelRun], model: str) -> dict[str, Any]:
    """One model's share of a mixed level: its requests, its output tokens/s in the window, TTFT and TPOT."""
    own = [dataclasses.replace(run, records=[r for r in run.records if r.model == model]) for run in runs]
    measured = [r for run in own for r in run.measured]
    ok = [r for r in measured if r.ok]
    return {
        "completed": len(ok),
        "failed": len(measured) - len(ok),
        "output_tokens_per_s": statistics.median(window_throughput(run)["output_tokens_per_s"] for run in own),
        "ttft": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot": distribution_ms([t for r in ok if (t := r.tpot) is not None]),
    }


def latency_value(level: dict[str, Any], metric: str, pct: str) -> float | None:
    dist = level["latency_ms"].get(metric)
    return None if dist is None else float(dist[pct])


def tpot_variation(records: list[RequestRecord]) -> float | None:
    """Coefficient of variation of per-request TPOT: the baseline stability check."""
    values = [t for r in records if (t := r.tpot) is not None]
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else None


# A level's server step time this much above what the other levels predict for its batch is disturbed.
STEP_DISTURBED_RATIO = 1.3
STEP_DISTURBED_FLOOR_MS = 2.0


def quiet_step_line(levels: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(intercept ms, slope ms per running request): the server's step time against its batch, Theil–Sen.

    The median of pairwise slopes and of the intercepts it leaves, so one or two
    levels slowed by a neighbour on the host do not move the line (up to ~29% of
    the levels may be outliers). None with fewer than four levels carrying both
    figures, or no two distinct batches.
    """
    points = []
    for lv in levels:
        load = (lv.get("server") or {}).get("load") or {}
        batch = load.get("batch_mean") or load.get("running_mean")
        if batch and load.get("step_time_ms"):
            points.append((float(batch), float(load["step_time_ms"])))
    slopes = [
        (s1 - s0) / (b1 - b0)
        for i, (b0, s0) in enumerate(points)
        for b1, s1 in points[i + 1 :]
        if abs(b1 - b0) > 0.5
    ]
    if len(points) < 4 or not slopes:
        return None
    slope = max(0.0, statistics.median(slopes))
    return statistics.median(s - slope * b for b, s in points), slope


def mark_disturbed(levels: list[dict[str, Any]], cfg: BenchConfig) -> list[dict[str, Any]]:
    """Add ``disturbed`` (reasons, figures) to each closed-loop level: was the host busy while it ran?

    Two witnesses: the load generator's own event-loop lag (p99 above
    ``cfg.disturbed_client_lag_ms``: the client could not keep up with its own
    schedule, so its latencies include its own waiting), and the server's step
    time against the quiet figure the other levels give for that batch
    (:func:`quiet_step_line`; above ×1.3 and +2 ms, the server's steps ran slow for
    a reason that is not the batch). Returns the levels marked (new dicts).
    """
    line = quiet_step_line([lv for lv in levels if lv["concurrency"] is not None])
    out = []
    for lv in levels:
        reasons = []
        lag = lv["client"]["loop_lag_p99_ms"]
        if lag > cfg.disturbed_client_lag_ms:
            reasons.append(
                f"client lag: the load generator's event loop woke up to {lag:.0f} ms late (p99 > "
                f"{cfg.disturbed_client_lag_ms:g} ms), so its timings include its own waiting"
            )
        load = (lv.get("server") or {}).get("load") or {}
        batch = load.get("batch_mean") or load.get("running_mean")
        step = load.get("step_time_ms")
        quiet = None
        if line is not None and batch and step:
            quiet = line[0] + line[1] * batch
            if step > STEP_DISTURBED_RATIO * quiet and step - quiet > STEP_DISTURBED_FLOOR_MS:
                reasons.append(
                    f"server step time {step:.1f} ms against a quiet {quiet:.1f} ms for a batch of "
                    f"{batch:.1f} (the line through the other levels): the server ran slow"
                )
        out.append(
            {
                **lv,
                "disturbed": {
                    "reasons": reasons,
                    "client_lag_p99_ms": lag,
                    "server_step_time_ms": step,
                    "quiet_step_time_ms": quiet,
                },
            }
        )
    return out
