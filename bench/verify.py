"""The hold that proves a recommendation: run at it for a while, step down until it holds.

What it is: after a sweep, :func:`verify` holds the recommended concurrency
closed-loop for ``cfg.verify_seconds``, cut into windows of :data:`WINDOW_S`
(at least :data:`MIN_WINDOWS`, so a short hold still has several); per window it
takes the percentiles the SLO names over the requests that finished in it (TTFT
p95, TPOT p50, E2E p95) and says whether the window met the SLO, and it also
counts the requests that met every bound on their own (goodput's per-request
attainment), output throughput, and the server's mean waiting requests (Little's
law on its queue-time histogram between the scrapes inside the window). A hold
passes when at least 99% of its windows met the SLO and the queue did not grow
(the last window's waiting above the first's by more than max(1, 10% of the
concurrency)); otherwise it steps down to ⌊0.75 c⌋ (at least one less) and holds
again, at most ``MAX_ATTEMPTS`` times. Per-request attainment is reported, not
judged: a p95 target allows 5% of requests above it by definition. Without an
SLO the bounds are the knee's own inflation limits on the lowest undisturbed
level. Each window and each hold's verdict is reported as it ends (``say``), with
the time left. :func:`apply_verification` writes the result into the report: the
verified concurrency becomes the recommendation, the swept one is kept beside it.

What it is not: knee finding (knees.py) or the sweep; it never raises the
recommendation above what the sweep found.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from plimsoll.bench.client import RequestRecord
from plimsoll.bench.config import SLO
from plimsoll.bench.knees import inflation_limits, is_disturbed
from plimsoll.bench.loadgen import LevelRun, run_concurrency
from plimsoll.bench.scrape import Snapshot, family_of, load_from_histograms
from plimsoll.bench.stats import STEP_DISTURBED_FLOOR_MS, STEP_DISTURBED_RATIO, meets_slo

MIN_ATTAINMENT = 0.99
MAX_ATTEMPTS = 4
WINDOW_S = 60.0
MIN_WINDOWS = 3

Say = Callable[[str], None]
FAILED_MS = 1e12  # a failed request's latency in a window's percentiles: longer than any bound


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
    """Windows of about :data:`WINDOW_S` (a 600 s hold: ten 1-minute windows), never fewer than three."""
    return max(MIN_WINDOWS, round(seconds / WINDOW_S))


def window_percentiles(finished: list[RequestRecord], slo: SLO) -> tuple[dict[str, float], list[str]]:
    """The percentiles ``slo`` names over ``finished`` (ms), and each bound they break, as text.

    A failed request counts as one that took forever, so failures move a percentile
    only as far as their share does (2 failed of 1,600 leave a p95 where it was).
    Without any bound, a window misses when more than 5% of its requests failed.
    """
    failed = sum(1 for r in finished if not r.ok)

    def samples(get: Callable[[RequestRecord], float | None]) -> list[float]:
        values = [get(r) if r.ok else None for r in finished]
        return [FAILED_MS if v is None else v * 1e3 for v in values]

    checks = (
        ("ttft_p95", slo.ttft_p95_ms, 95, lambda r: r.ttft),
        ("tpot_p50", slo.tpot_p50_ms, 50, lambda r: r.tpot),
        ("e2e_p95", slo.e2e_p95_ms, 95, lambda r: r.e2e),
    )
    values: dict[str, float] = {}
    broken = []
    for name, bound, q, get in checks:
        if bound is None or not finished:
            continue
        value = float(np.percentile(np.asarray(samples(get)), q))
        label = name.replace("_", " ").upper()
        if value >= FAILED_MS / 10:  # the percentile reaches into the failures
            broken.append(f"{label}: {failed} of {len(finished)} requests failed")
            continue
        values[name] = value
        if value > bound:
            broken.append(f"{label} {value:.0f} > {bound:g} ms")
    unbounded = all(b is None for b in (slo.ttft_p95_ms, slo.tpot_p50_ms, slo.e2e_p95_ms))
    if unbounded and finished and failed > 0.05 * len(finished):
        broken.append(f"{failed} of {len(finished)} requests failed")
    return values, broken


def _server_load(samples: list[Snapshot], lo: float, hi: float) -> dict[str, Any]:
    """What the server's histograms say between the first and last scrape inside ``lo..hi``."""
    inside = [s for s in samples if lo <= s.t <= hi]
    if len(inside) < 2:
        return {}
    fam = family_of(inside[-1])
    return {} if fam is None else load_from_histograms(inside[0], inside[-1], fam)


def reference_step_ms(levels: list[dict[str, Any]], concurrency: int) -> float | None:
    """The server's mean step time the sweep measured at ``concurrency`` (linear between the levels
    around it, the nearest level outside them); None when the sweep has no server figures."""
    points = []
    for lv in levels:
        load = (lv.get("server") or {}).get("load") or {}
        if lv.get("valid") and lv.get("concurrency") is not None and load.get("step_time_ms"):
            points.append((float(lv["concurrency"]), float(load["step_time_ms"])))
    if not points:
        return None
    xs, ys = zip(*sorted(points), strict=True)
    return float(np.interp(concurrency, xs, ys))  # held at the end levels outside them


def disturbance(step_ms: float | None, reference_ms: float | None) -> str | None:
    """Why a window's server ran slower than the sweep did at this concurrency, or None.

    The hold runs at a level the sweep measured, so a step time well above the
    sweep's there (×1.3 and +2 ms, the sweep's own rule) is the host, not the load.
    """
    if step_ms is None or reference_ms is None:
        return None
    if step_ms > STEP_DISTURBED_RATIO * reference_ms and step_ms - reference_ms > STEP_DISTURBED_FLOOR_MS:
        return f"server step time {step_ms:.1f} ms against {reference_ms:.1f} ms in the sweep at this concurrency"
    return None


def windows_of(
    run: LevelRun,
    slo: SLO,
    n: int,
    samples: list[Snapshot],
    to_monotonic: float,
    reference_ms: float | None = None,
) -> list[dict[str, Any]]:
    """Cut the hold's measurement window into ``n`` equal windows and judge each; a window whose
    server stepped slower than ``reference_ms`` allows is marked ``disturbed``."""
    span = (run.window_end - run.window_start) / n
    out = []
    for i in range(n):
        lo, hi = run.window_start + i * span, run.window_start + (i + 1) * span
        finished = [r for r in run.records if r.measured and r.end is not None and lo <= r.end < hi]
        good = [r for r in finished if meets_slo(r, slo)]
        percentiles, broken = window_percentiles(finished, slo)
        tokens = sum(
            r.n_output / len(r.chunk_times) * sum(1 for t in r.chunk_times if lo <= t < hi)
            for r in run.records
            if r.chunk_times
        )
        load = _server_load(samples, lo + to_monotonic, hi + to_monotonic)
        out.append(
            {
                "start_s": round(lo - run.window_start, 3),
                "end_s": round(hi - run.window_start, 3),
                "finished": len(finished),
                "good": len(good),
                "attainment": len(good) / len(finished) if finished else None,
                "percentiles_ms": percentiles,
                "met_slo": bool(finished) and not broken,
                "broken": broken,
                "output_tokens_per_s": tokens / span if span > 0 else 0.0,
                "waiting_mean": load.get("waiting_mean"),
                "step_time_ms": load.get("step_time_ms"),
                "disturbed": disturbance(load.get("step_time_ms"), reference_ms),
            }
        )
    return out


def judge(windows: list[dict[str, Any]], concurrency: int) -> tuple[bool, float | None, float | None, str]:
    """(passed, share of windows that met the SLO, queue growth, why) of one hold.

    Windows where no request finished are not judged (too short for the requests),
    nor disturbed ones (the host, not the load: see :func:`inconclusive`); when none
    is left the hold fails.
    """
    judged = [w for w in windows if w["finished"] and not w.get("disturbed")]
    disturbed = [w for w in windows if w.get("disturbed")]
    met = [w for w in judged if w["met_slo"]]
    attainment = len(met) / len(judged) if judged else None
    finished = sum(w["finished"] for w in judged)
    good = sum(w["good"] for w in judged)
    per_request = f"{good}/{finished} requests within every bound" if finished else ""
    waits = [w["waiting_mean"] for w in windows if w["waiting_mean"] is not None]
    growth = waits[-1] - waits[0] if len(waits) >= 2 else None
    allowed = max(1.0, 0.1 * concurrency)
    problems = []
    if attainment is None:
        problems.append("no request finished during the hold")
    elif attainment < MIN_ATTAINMENT:
        misses = [
            f"{w['start_s']:g}–{w['end_s']:g} s: {', '.join(w['broken'])}" for w in judged if not w["met_slo"]
        ]
        problems.append(
            f"SLO attainment {attainment:.1%} < {MIN_ATTAINMENT:.0%}: {len(judged) - len(met)} of "
            f"{len(judged)} windows missed ({'; '.join(misses[:5])}{'; …' if len(misses) > 5 else ''}); "
            + per_request
        )
    if growth is not None and growth > allowed:
        problems.append(
            f"the server's queue grew by {growth:.1f} waiting requests from the first window to the last "
            f"(more than {allowed:g})"
        )
    noted = "; ".join(f"{w['start_s']:g} s: {w['disturbed']}" for w in disturbed[:3])
    aside = f"; {len(disturbed)} disturbed window(s) not judged ({noted})" if disturbed else ""
    if problems:
        return False, attainment, growth, "; ".join(problems) + aside
    assert attainment is not None
    return (
        True,
        attainment,
        growth,
        f"SLO attainment {attainment:.1%}: {len(met)} of {len(judged)} windows met the SLO, {per_request}, "
        "no growing queue" + aside,
    )


def inconclusive(windows: list[dict[str, Any]]) -> str | None:
    """Why a hold proves nothing either way (over half its windows disturbed), or None.

    Stepping down would not help: a lower level measured on the same busy host
    proves as little, so the hold stops there and says so.
    """
    disturbed = [w for w in windows if w.get("disturbed")]
    if 2 * len(disturbed) <= len(windows):
        return None
    return (
        f"the host was busy in {len(disturbed)} of {len(windows)} windows "
        f"(e.g. {disturbed[0]['start_s']:g} s: {disturbed[0]['disturbed']}), so the hold proves nothing; "
        "re-run it on a quieter host"
    )


def _window_progress(
    say: Say | None, concurrency: int, seconds: float, n: int, attempt: int
) -> Callable[[int, int], None] | None:
    """A loadgen progress callback that reports once per window: time held, requests, time left."""
    if say is None:
        return None
    began = time.perf_counter()
    state = {"next": 1}

    def progress(done: int, failed: int) -> None:
        elapsed = time.perf_counter() - began
        boundary = state["next"] * seconds / n
        if elapsed < boundary or state["next"] >= n:
            return
        state["next"] = math.floor(elapsed / (seconds / n)) + 1
        left = max(0.0, seconds - elapsed)
        failures = f", {failed} failed" if failed else ""
        say(
            f"hold {attempt}: c={concurrency} {elapsed:.0f}/{seconds:g} s, {done} requests done{failures}, "
            f"~{left:.0f} s left in this hold"
        )

    return progress


async def hold(
    session: Any,
    concurrency: int,
    seconds: float,
    slo: SLO,
    say: Say | None = None,
    attempt: int = 1,
    levels: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run ``concurrency`` clients for ``seconds`` (after a warm-up round) and judge the windows;
    ``levels`` (the sweep's) give the step time a quiet host had at this concurrency."""
    cfg = session.cfg.model_copy(
        update={"duration_per_level_s": seconds, "requests_per_level": None, "warmup_requests": None}
    )
    to_monotonic = time.monotonic() - time.perf_counter()
    n = window_count(seconds)
    progress = _window_progress(say, concurrency, seconds, n, attempt)
    run = await run_concurrency(
        session.client, session.workload, cfg, concurrency, 0, session.scraper, progress=progress
    )
    session.runs.append(run)
    samples = list(session.scraper.samples) if session.scraper is not None else []
    reference = reference_step_ms(levels or [], concurrency)
    windows = windows_of(run, slo, n, samples, to_monotonic, reference)
    passed, attainment, growth, why = judge(windows, concurrency)
    unsure = inconclusive(windows)
    if unsure is not None:
        passed, why = False, f"inconclusive: {unsure}; {why}"
    finished = sum(w["finished"] for w in windows)
    span = max(run.window_end - run.window_start, 1e-9)
    tokens = sum(w["output_tokens_per_s"] for w in windows) / len(windows)
    return {
        "concurrency": concurrency,
        "seconds": round(span, 3),
        "passed": passed,
        "attainment": attainment,
        "windows_met": sum(1 for w in windows if w["met_slo"]),
        "windows_disturbed": sum(1 for w in windows if w.get("disturbed")),
        "inconclusive": unsure,
        "reference_step_time_ms": reference,
        "request_attainment": sum(w["good"] for w in windows) / finished if finished else None,
        "queue_growth": growth,
        "output_tokens_per_s": tokens,
        "windows": windows,
        "why": why,
    }


def step_down(concurrency: int) -> int:
    return max(1, min(concurrency - 1, math.floor(0.75 * concurrency)))


async def verify(session: Any, report: dict[str, Any], say: Say | None = None) -> dict[str, Any] | None:
    """Hold the report's recommendation, stepping down until a hold passes; None when there is none to hold.

    ``say`` gets a line per window and per hold (where it is, the verdict, the time left).
    """
    start = report["recommendation"]["concurrency_per_replica"]
    seconds = session.cfg.verify_seconds
    if start is None or seconds <= 0:
        return None
    slo, source = hold_slo(report, session.cfg.slo)
    tried: list[dict[str, Any]] = []
    c = start
    while True:
        attempt = await hold(session, c, seconds, slo, say, len(tried) + 1, report.get("levels"))
        tried.append(attempt)
        last = (
            attempt["passed"] or attempt["inconclusive"] is not None or c == 1 or len(tried) >= MAX_ATTEMPTS
        )
        if say is not None:
            verdict = "held" if attempt["passed"] else "missed"
            then = "" if last else f"; stepping down to c={step_down(c)}, another {seconds:g} s hold"
            say(f"hold {len(tried)}: c={c} {verdict} — {attempt['why']}{then}")
        if last:
            break
        c = step_down(c)
    verified = tried[-1]["concurrency"] if tried[-1]["passed"] else None
    return {
        "verified_concurrency": verified,
        "swept_concurrency": start,
        "seconds": seconds,
        "windows_per_hold": window_count(seconds),
        "window_seconds": round(seconds / window_count(seconds), 3),
        "min_attainment": MIN_ATTAINMENT,
        "judged_by": source,
        "bounds_ms": slo.model_dump(),
        "attainment": tried[-1]["attainment"] if verified is not None else None,
        "windows_met": tried[-1]["windows_met"] if verified is not None else None,
        "request_attainment": tried[-1]["request_attainment"] if verified is not None else None,
        "windows_measured": sum(len(t["windows"]) for t in tried),
        "inconclusive": tried[-1]["inconclusive"],
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
    if verification.get("inconclusive") and verified is None:
        # A busy host proves nothing either way: keep the sweep's figure, say it is unproven.
        rec["reason"] = f"{rec['reason']}; not verified: {steps}"
        return {
            **report,
            "recommendation": rec,
            "verification": verification,
            "warnings": [
                *report["warnings"],
                f"verification inconclusive at c={verification['tried'][-1]['concurrency']}: "
                f"{verification['inconclusive']}; the recommendation {swept} is the sweep's, unverified",
            ],
        }
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
