"""Knee finding on synthetic level data: the rules, the Kneedle resampling fix, the recommendation."""

import math
from typing import Any

import pytest

from plimsoll.bench.config import SLO, BenchConfig
from plimsoll.bench.knees import (
    confidence,
    host_delay_ms,
    kneedle,
    latency_knee,
    queueing,
    recommend,
    throughput_knee,
)
from plimsoll.bench.stats import mark_disturbed

GEOMETRIC = [1, 2, 4, 8, 16, 32, 48, 64]


def level(c: int, ttft_p95: float, tpot_p50: float, e2e_p95: float | None = None) -> dict[str, Any]:
    def dist(v: float) -> dict[str, float]:
        return {"mean": v, "p50": v, "p90": v, "p95": v, "p99": v}

    return {
        "concurrency": c,
        "latency_ms": {
            "ttft": dist(ttft_p95),
            "tpot": dist(tpot_p50),
            "itl": dist(tpot_p50),
            "e2e": dist(e2e_p95 if e2e_p95 is not None else 10 * tpot_p50),
        },
    }


def test_kneedle_finds_no_knee_on_a_straight_line_with_geometric_levels() -> None:
    # Raw kneed on these x values reports a false knee at 8 (kneed issue #98).
    assert kneedle([float(c) for c in GEOMETRIC], [float(c) for c in GEOMETRIC]) is None


def test_kneedle_finds_a_hard_cap_after_resampling() -> None:
    xs = [float(c) for c in GEOMETRIC]
    knee = kneedle(xs, [min(c, 32.0) for c in xs])
    assert knee is not None and 28 <= knee <= 33


def test_throughput_knee_is_smallest_level_reaching_90_percent() -> None:
    cap = 16
    pts = [(c, 100.0 * min(c, cap) / (1 + 0.01 * min(c, cap))) for c in GEOMETRIC]
    knee = throughput_knee(pts)
    assert knee.concurrency == 16
    assert knee.best_output_tokens_per_s == pytest.approx(max(x for _, x in pts))


def test_throughput_still_rising_is_no_knee() -> None:
    knee = throughput_knee([(c, 10.0 * c) for c in GEOMETRIC])
    assert knee.concurrency is None
    assert "no knee within the tested range" in knee.reason
    assert knee.kneedle_concurrency is None


def test_latency_knee_interpolates_where_ttft_inflation_crosses_3x() -> None:
    # TTFT p95 100 ms up to c=8, then 500 ms at 16: the 3× limit (300 ms) is crossed in between.
    levels = [level(c, 100 if c <= 8 else 500, 20) for c in (1, 2, 4, 8, 16, 32)]
    knee = latency_knee(levels, SLO())
    assert knee.status == "found" and knee.binding == "ttft_p95"
    # worst margin at 8 is TPOT's -0.5 (20 of 40 ms), at 16 TTFT's +0.667: linear in log2 c between
    assert knee.concurrency == pytest.approx(2 ** (3 + 0.5 / (0.5 + 2 / 3)), rel=0.01)


def test_latency_knee_uses_tpot_inflation_and_is_monotone() -> None:
    # TPOT doubles past c=4, then a noisy dip at 16 must not reopen the range.
    tpots = {1: 10, 2: 11, 4: 15, 8: 25, 16: 18, 32: 40}
    knee = latency_knee([level(c, 50, tpots[c]) for c in tpots], SLO())
    assert knee.binding == "tpot_p50"
    assert 4 < knee.concurrency < 8  # type: ignore[operator]


def test_slo_knee_and_below_range() -> None:
    levels = [level(c, 40 * c, 20) for c in (1, 2, 4, 8)]
    knee = latency_knee(levels, SLO(ttft_p95_ms=200))
    assert knee.basis == "slo" and knee.status == "found"
    assert 4 < knee.concurrency < 8  # type: ignore[operator]  # 160 ms passes, 320 fails
    below = latency_knee(levels, SLO(ttft_p95_ms=10))
    assert below.status == "below_range" and below.concurrency is None
    none = latency_knee(levels, SLO(ttft_p95_ms=10_000))
    assert none.status == "none" and "no knee within the tested range" in none.reason


def test_recommendation_floors_headroom_times_smallest_knee() -> None:
    thr = throughput_knee([(c, float(min(c, 32))) for c in GEOMETRIC])
    lat = latency_knee([level(c, 100 if c <= 16 else 900, 20) for c in GEOMETRIC], SLO())
    rec = recommend(thr, lat, 0.75)
    assert lat.concurrency is not None and thr.concurrency == 32
    assert rec.limited_by == "latency"
    assert rec.concurrency_per_replica == math.floor(0.75 * lat.concurrency)


def test_no_recommendation_without_knees_or_below_range() -> None:
    thr = throughput_knee([(c, 10.0 * c) for c in GEOMETRIC])
    lat = latency_knee([level(c, 100, 20) for c in GEOMETRIC], SLO())
    assert recommend(thr, lat, 0.75).concurrency_per_replica is None
    below = latency_knee([level(c, 100, 20) for c in GEOMETRIC], SLO(tpot_p50_ms=1))
    assert recommend(thr, below, 0.75).concurrency_per_replica is None


def served(
    c: int, ttft: float, tpot: float, queue_ms: float, running: float, step_ms: float
) -> dict[str, Any]:
    """A level with the server's histogram view of it (bench.scrape.load_from_histograms)."""
    lv = level(c, ttft, tpot)
    lv["server"] = {
        "load": {
            "queue_time_mean_ms": queue_ms,
            "step_time_ms": step_ms,
            "running_mean": running,
            "batch_mean": None,
        }
    }
    lv["client"] = {"loop_lag_p99_ms": 1.0}
    lv["requests"] = {"completed": 120}
    lv["throughput"] = {"output_tokens_per_s": 10.0 * min(c, 12)}
    return lv


def test_absolute_floors_keep_small_latencies_from_being_a_knee() -> None:
    # TTFT 20 → 70 ms is 3.5× but only +50 ms; TPOT 4 → 9 ms is 2.25× but only +5 ms.
    levels = [level(c, 20 if c < 8 else 70, 4 if c < 8 else 9) for c in (1, 2, 4, 8, 16)]
    knee = latency_knee(levels, SLO())
    assert knee.status == "none", knee.reason
    assert knee.limits_ms == {"ttft_p95": 120.0, "tpot_p50": 14.0}


def test_no_slo_knee_is_where_the_server_starts_to_queue() -> None:
    # Cap 12: no queue up to 12; at 16 four wait and the server holds 11.6.
    levels = [served(c, 40, 20, 0.0 if c <= 12 else 90.0, min(c, 11.6), 20) for c in (1, 2, 4, 8, 12, 16, 24)]
    knee = latency_knee(levels, SLO())
    assert knee.status == "found" and knee.binding == "queueing" and knee.basis == "queueing_and_inflation"
    assert knee.concurrency == 12.0  # the held 11.6, clamped to the last level that did not queue
    assert [m["queueing"] for m in knee.margins] == [False] * 5 + [True] * 2
    # One step of waiting (a request joining at the next step boundary) is not a queue.
    assert (
        queueing(served(8, 40, 20, 19.0, 8, 20)) is False and queueing(served(8, 40, 20, 21.0, 8, 20)) is True
    )
    # Client inflation first seen at a queueing level is that queue: the server's figure binds.
    slow_ttft = [
        served(c, 40 if c <= 12 else 400, 20, 0.0 if c <= 12 else 90.0, min(c, 11.6), 20)
        for c in (1, 4, 8, 12, 16)
    ]
    assert latency_knee(slow_ttft, SLO()).concurrency == 12.0
    # Client inflation before any queue (TPOT doubling with the batch) binds where it crosses.
    tpot_grows = [
        served(c, 40, 20 if c <= 4 else 60, 0.0 if c <= 12 else 90.0, min(c, 11.6), 20)
        for c in (1, 2, 4, 8, 12, 16)
    ]
    early = latency_knee(tpot_grows, SLO())
    assert early.binding == "tpot_p50" and 4 < early.concurrency < 8  # type: ignore[operator]


def test_a_busy_hosts_scheduling_delay_is_not_a_queue() -> None:
    # A loaded host delays the engine's loop: 6 ms of "queue" at one client, where nothing can queue, and
    # the same 6 ms carried by every level. Cap 4: the real queue starts at 8.
    levels = [served(c, 40, 20, 6.0 if c <= 4 else 96.0, min(c, 3.8), 4) for c in (1, 2, 4, 8, 16)]
    assert host_delay_ms(levels) == 6.0
    knee = latency_knee(levels, SLO())
    assert knee.status == "found" and knee.binding == "queueing" and knee.concurrency == 4.0, knee.reason
    assert [m["queueing"] for m in knee.margins] == [False, False, False, True, True]
    # Without the one-client level to read the host from, 6 ms over a 4 ms step counts as a queue.
    assert queueing(served(2, 40, 20, 6.0, 2, 4)) is True
    assert queueing(served(2, 40, 20, 6.0, 2, 4), host_ms=6.0) is False
    assert queueing(served(1, 40, 20, 50.0, 1, 4)) is False  # one client never queues


def test_with_slos_a_disturbed_level_is_not_judged_while_quiet_ones_remain() -> None:
    # c=1 ran while the host was busy (its client lagged): 900 ms TTFT against a 300 ms SLO. The quiet
    # levels meet it up to 8 and miss at 16: the knee is theirs, not "below range".
    levels = [level(c, 900 if c == 1 else (100 if c <= 8 else 600), 20) for c in (1, 2, 4, 8, 16)]
    levels[0]["disturbed"] = {"reasons": ["client lag p99 80 ms"]}
    knee = latency_knee(levels, SLO(ttft_p95_ms=300))
    assert knee.status == "found" and 8 < knee.concurrency < 16, knee.reason  # type: ignore[operator]
    # Every level disturbed: they are all there is, and c=1 is judged.
    for lv in levels:
        lv["disturbed"] = {"reasons": ["client lag p99 80 ms"]}
    assert latency_knee(levels, SLO(ttft_p95_ms=300)).status == "below_range"


def test_disturbed_levels_are_marked_with_why_and_left_out_of_client_limits() -> None:
    cfg = BenchConfig(url="http://127.0.0.1:1")
    # Step time 20 + 1·batch ms, except c=8 whose steps ran at 45 ms; c=4's client lagged 80 ms.
    levels = [
        served(c, 40, 20, 0.0 if c <= 12 else 90.0, min(c, 12), 20 + min(c, 12)) for c in (1, 2, 4, 8, 12, 16)
    ]
    levels[3]["server"]["load"]["step_time_ms"] = 45.0
    levels[2]["client"]["loop_lag_p99_ms"] = 80.0
    levels[2]["latency_ms"]["ttft"] = {k: 900.0 for k in ("mean", "p50", "p90", "p95", "p99")}
    marked = mark_disturbed(levels, cfg)
    reasons = {lv["concurrency"]: lv["disturbed"]["reasons"] for lv in marked}
    assert [c for c, why in reasons.items() if why] == [4, 8]
    assert reasons[4][0].startswith("client lag") and "80 ms" in reasons[4][0]
    assert reasons[8][0].startswith("server step time 45.0 ms against a quiet 28.0 ms")
    # c=4's 900 ms TTFT is the host, not the server: the knee stays where the queue begins.
    knee = latency_knee(marked, SLO())
    assert knee.binding == "queueing" and knee.concurrency == 12.0
    note = confidence(marked, knee.concurrency)
    assert note["rating"] == "low" and note["disturbed_levels"] == [4, 8] and "c=8" in note["note"]
