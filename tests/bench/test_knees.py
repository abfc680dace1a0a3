"""Knee finding on synthetic level data: the rules, the Kneedle resampling fix, the recommendation."""

import math
from typing import Any

import pytest

from plimsoll.bench.config import SLO
from plimsoll.bench.knees import kneedle, latency_knee, recommend, throughput_knee

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
