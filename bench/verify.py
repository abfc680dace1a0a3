"""The hold that proves a recommendation: run at it for a while, step down until it holds.

What it is: after a sweep, :func:`verify` holds the recommended concurrency
closed-loop for ``cfg.verify_seconds``, cut into windows; per window it counts
the requests that finished, how many met the SLO (each percentile SLO applied
as a per-request bound, as goodput does), output throughput, and the server's
mean waiting requests (Little's law on its queue-time histogram between the
scrapes inside the window). A hold passes with attainment ≥ 99% over its windows
and no growing queue (the last window's waiting above the first's by more than
max(1, 10% of the concurrency)); otherwise it steps down to ⌊0.75 c⌋ (at least
one less) and holds again, at most ``MAX_ATTEMPTS`` times. Without an SLO the
bound is the knee's own inflation limits on the lowest undisturbed level.
:func:`apply_verification` writes the result into the report: the verified
concurrency becomes the recommendation, the swept one is kept beside it.

What it is not: knee finding (knees.py) or the sweep; it never raises the
recommendation above what the sweep found.
"""

from __future__ import annotations

import math
import time
from typing import Any

from plimsoll.bench.config import SLO
from plimsoll.bench.knees import inflation_limits, is_disturbed
from plimsoll.bench.loadgen import LevelRun, run_concurrency
from plimsoll.bench.scrape import Snapshot, family_of, load_from_histograms
from plimsoll.bench.stats import meets_slo

MIN_ATTAINMENT = 0.99
MAX_ATTEMPTS = 4
WINDOW_S = 10.0
MIN_WINDOWS = 3


def hold_slo(report: dict[str, Any], slo: SLO) -> tuple[SLO, str]:
    """The per-request bounds a hold is judged by, and where they come from."""
    if slo.is_set():
        return slo, "the SLO"
    valid = [lv for lv in report["levels"] if lv["valid"] and lv["concurrency"] is not None]
    base = next((lv for lv in valid if not is_disturbed(lv)), valid[0] if valid else None)
    limits = inflation_limits(base) if base is not None else {}
    bounds = SLO(
        ttft_p95_ms=limits["ttft_p95"][2] if "ttft_p95" in limits else None,
        tpot_p50_ms=limits["tpot_p50"][2] if "tpot_p50" in limits else None,
    )
    where = "no SLO given: the latency knee's inflation limits" + (
        f" of c={base['concurrency']}" if base is not None else ""
    )
    return bounds, where


def window_count(seconds: float) -> int:
    return max(MIN_WINDOWS, math.ceil(seconds / WINDOW_S))


def _waiting(samples: list[Snapshot], lo: float, hi: float) -> float | None:
    inside = [s for s in samples if lo <= s.t <= hi]
    if len(inside) < 2:
        return None
    fam = family_of(inside[-1])
    return None if fam is None else load_from_histograms(inside[0], inside[-1], fam)["waiting_mean"]


def windows_of(
    run: LevelRun, slo: SLO, n: int, samples: list[Snapshot], to_monotonic: float
) -> list[dict[str, Any]]:
    """Cut the hold's measurement window into ``n`` equal windows and judge each."""
    span = (run.window_end - run.window_start) / n
    out = []
    for i in range(n):
        lo, hi = run.window_start + i * span, run.window_start + (i + 1) * span
        finished = [r for r in run.records if r.measured and r.end is not None and lo <= r.end < hi]
        good = [r for r in finished if meets_slo(r, slo)]
        tokens = sum(
            r.n_output / len(r.chunk_times) * sum(1 for t in r.chunk_times if lo <= t < hi)
            for r in run.records
            if r.chunk_times
        )
        out.append(
            {
                "start_s": round(lo - run.window_start, 3),
                "end_s": round(hi - run.window_start, 3),
                "finished": len(finished),
                "good": len(good),
                "attainment": len(good) / len(finished) if finished else None,
                "output_tokens_per_s": tokens / span if span > 0 else 0.0,
                "waiting_mean": _waiting(samples, lo + to_monotonic, hi + to_monotonic),
            }
        )
    return out


def judge(windows: list[dict[str, Any]], concurrency: int) -> tuple[bool, float | None, float | None, str]:
    """(passed, attainment, queue growth, why) of one hold."""
    finished = sum(w["finished"] for w in windows)
    good = sum(w["good"] for w in windows)
    attainment = good / finished if finished else None
    waits = [w["waiting_mean"] for w in windows if w["waiting_mean"] is not None]
    growth = waits[-1] - waits[0] if len(waits) >= 2 else None
    allowed = max(1.0, 0.1 * concurrency)
    problems = []
    if attainment is None:
        problems.append("no request finished during the hold")
    elif attainment < MIN_ATTAINMENT:
        misses = [
            f"{w['start_s']:g}–{w['end_s']:g} s: {w['good']}/{w['finished']}"
            for w in windows
            if w["finished"] and w["good"] < w["finished"]
        ]
        problems.append(
            f"attainment {attainment:.1%} < {MIN_ATTAINMENT:.0%} ({finished - good} of {finished} requests "
            f"missed; windows {', '.join(misses)})"
        )
    if growth is not None and growth > allowed:
        problems.append(
            f"the server's queue grew by {growth:.1f} waiting requests from the first window to the last "
            f"(more than {allowed:g})"
        )
    if problems:
        return False, attainment, growth, "; ".join(problems)
    return (
        True,
        attainment,
        growth,
        f"attainment {attainment:.1%} over {len(windows)} windows, no growing queue",
    )


async def hold(session: Any, concurrency: int, seconds: float, slo: SLO) -> dict[str, Any]:
    """Run ``concurrency`` clients for ``seconds`` (after a warm-up round) and judge the windows."""
    cfg = session.cfg.model_copy(
        update={"duration_per_level_s": seconds, "requests_per_level": None, "warmup_requests": None}
    )
    to_monotonic = time.monotonic() - time.perf_counter()
    run = await run_concurrency(session.client, session.workload, cfg, concurrency, 0, session.scraper)
    session.runs.append(run)
    samples = list(session.scraper.samples) if session.scraper is not None else []
    windows = windows_of(run, slo, window_count(seconds), samples, to_monotonic)
    passed, attainment, growth, why = judge(windows, concurrency)
    span = max(run.window_end - run.window_start, 1e-9)
    tokens = sum(w["output_tokens_per_s"] for w in windows) / len(windows)
    return {
        "concurrency": concurrency,
        "seconds": round(span, 3),
        "passed": passed,
        "attainment": attainment,
        "queue_growth": growth,
        "output_tokens_per_s": tokens,
        "windows": windows,
        "why": why,
    }


def step_down(concurrency: int) -> int:
    return max(1, min(concurrency - 1, math.floor(0.75 * concurrency)))


async def verify(session: Any, report: dict[str, Any]) -> dict[str, Any] | None:
    """Hold the report's recommendation, stepping down until a hold passes; None when there is none to hold."""
    start = report["recommendation"]["concurrency_per_replica"]
    seconds = session.cfg.verify_seconds
    if start is None or seconds <= 0:
        return None
    slo, source = hold_slo(report, session.cfg.slo)
    tried: list[dict[str, Any]] = []
    c = start
    while True:
        attempt = await hold(session, c, seconds, slo)
        tried.append(attempt)
        if attempt["passed"] or c == 1 or len(tried) >= MAX_ATTEMPTS:
            break
        c = step_down(c)
    verified = tried[-1]["concurrency"] if tried[-1]["passed"] else None
    return {
        "verified_concurrency": verified,
        "swept_concurrency": start,
        "seconds": seconds,
        "windows_per_hold": window_count(seconds),
        "min_attainment": MIN_ATTAINMENT,
        "judged_by": source,
        "bounds_ms": slo.model_dump(),
        "attainment": tried[-1]["attainment"] if verified is not None else None,
        "windows_measured": sum(len(t["windows"]) for t in tried),
        "tried": tried,
    }


def apply_verification(report: dict[str, Any], verification: dict[str, Any]) -> dict[str, Any]:
    """The report with ``verification`` and the verified concurrency as its recommendation."""
    rec = dict(report["recommendation"])
    swept = rec["concurrency_per_replica"]
    verified = verification["verified_concurrency"]
    steps = ", ".join(
        f"c={t['concurrency']} {'held' if t['passed'] else 'missed'} ({t['why']})"
        for t in verification["tried"]
    )
    rec["swept_concurrency_per_replica"] = swept
    rec["concurrency_per_replica"] = verified
    if verified is None:
        rec["reason"] = (
            f"{rec['reason']}, but no concurrency held under a {verification['seconds']:g} s hold: {steps}; "
            "the replica cannot carry this SLO steadily, so there is no recommendation"
        )
    elif verified == swept:
        rec["reason"] = f"{rec['reason']}; verified: {steps}"
    else:
        rec["reason"] = f"{rec['reason']}; stepped down to {verified} under load: {steps}"
    out = {**report, "recommendation": rec, "verification": verification}
    if verified != swept:
        out["warnings"] = [
            *report["warnings"],
            f"verification: the swept recommendation {swept} did not hold; "
            + (f"recommending {verified}" if verified is not None else "no concurrency held"),
        ]
    return out
