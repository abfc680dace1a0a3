"""The per-replica rules: the latency crossing, ⌊headroom × min(knees)⌋, and bench and operator agreeing on them."""

import math
from typing import Any

import pytest

from plimsoll.bench.config import SLO
from plimsoll.bench.knees import latency_knee, throughput_knee
from plimsoll.bench.knees import recommend as bench_recommend
from plimsoll.capacity import latency_crossing, recommend
from plimsoll.operator.scaling.profile import CapacityProfile, read_profile


def test_crossing_is_interpolated_in_log2_concurrency_and_monotone() -> None:
    # 0.5 under the limit at 4, 1.0 over at 8 → crosses a third of the way from log2 4 to log2 8;
    # the dip at 16 must not reopen the range.
    observed = {1: 50.0, 4: 50.0, 8: 200.0, 16: 60.0}
    crossing = latency_crossing([(c, {"ttft_p95": v}) for c, v in observed.items()], {"ttft_p95": 100.0})
    assert crossing.status == "found" and crossing.binding == "ttft_p95"
    assert crossing.concurrency == pytest.approx(2 ** (2 + 1 / 3), abs=0.01)
    assert (crossing.last_pass, crossing.first_fail) == (4, 8)
    assert [m["monotone_margin"] for m in crossing.margins] == [-0.5, -0.5, 1.0, 1.0]


def test_crossing_none_below_range_and_unmeasured() -> None:
    levels = [(1, {"tpot_p50": 10.0}), (2, {"tpot_p50": 12.0})]
    assert latency_crossing(levels, {"tpot_p50": 50.0}).status == "none"
    below = latency_crossing(levels, {"tpot_p50": 5.0})
    assert below.status == "below_range" and below.first_fail == 1 and below.concurrency is None
    # A limit on something never measured fails at once: no number is a pass.
    assert latency_crossing(levels, {"ttft_p95": 100.0}).status == "below_range"
    assert latency_crossing([], {"ttft_p95": 1.0}).status == "no_data"
    assert latency_crossing(levels, {}).status == "no_data"


def test_recommend_floors_the_smallest_knee_and_never_goes_below_one() -> None:
    rec = recommend({"throughput": 16, "latency": 18.5}, 0.75)
    assert (rec.concurrency_per_replica, rec.limited_by, rec.reason) == (
        12,
        "throughput",
        "⌊0.75 × throughput knee 16⌋ = 12",
    )
    assert recommend({"throughput": None, "latency": 1.2}, 0.5).concurrency_per_replica == 1
    none = recommend({"throughput": None, "latency": None}, 0.75)
    assert none.concurrency_per_replica is None and "extend --levels" in none.reason


def level(c: int, ttft_p95: float, tpot_p50: float) -> dict[str, Any]:
    def dist(v: float) -> dict[str, float]:
        return {"mean": v, "p50": v, "p90": v, "p95": v, "p99": v}

    return {"concurrency": c, "valid": True, "latency_ms": {"ttft": dist(ttft_p95), "tpot": dist(tpot_p50),
                                                           "e2e": dist(10 * tpot_p50)}}  # fmt: skip


@pytest.mark.parametrize("ttft_slo_ms", [90.0, 150.0, 400.0, 5000.0])
def test_bench_and_operator_derive_the_same_concurrency_for_an_slo(ttft_slo_ms: float) -> None:
    levels = [level(c, 20.0 * c, 10.0 + c) for c in (1, 2, 4, 8, 16, 32)]
    tokens = [(c, 100.0 * min(c, 16)) for c in (1, 2, 4, 8, 16, 32)]
    thr = throughput_knee(tokens)
    bench = bench_recommend(thr, latency_knee(levels, SLO(ttft_p95_ms=ttft_slo_ms)), 0.75)
    # The operator reads a report measured against another SLO (none) and re-derives.
    unslo = bench_recommend(thr, latency_knee(levels, SLO()), 0.75)
    profile = read_profile({
        "schema_version": "1.0", "levels": levels,
        "knees": {"throughput": {"concurrency": thr.concurrency}, "latency": {"concurrency": None}},
        "recommendation": {"concurrency_per_replica": unslo.concurrency_per_replica, "headroom": 0.75},
    })  # fmt: skip
    assert isinstance(profile, CapacityProfile)
    value, how = profile.concurrency_for(ttft_p95_ms=ttft_slo_ms)
    assert (value, how) == (bench.concurrency_per_replica, bench.reason)
    assert value == math.floor(0.75 * min(k for k in (thr.concurrency, bench.knee_concurrency) if k))
