"""Must-show 1: knees found against a simulated server match the analytic service curve."""

import math

import pytest
from benchkit import sweep_simulator

from plimsoll.bench.simulator import ServiceCurve, analytic_knees

# Step times of 50-100 ms keep the HTTP round trip (a few ms on an idle machine, tens
# on a loaded one) small against the service curve, so "analytic" stays meaningful.
CONFIGS = [
    pytest.param(ServiceCurve(batch_cap=2, step_t0_s=0.1), (1, 2, 4, 8), id="cap2-flat"),
    pytest.param(ServiceCurve(batch_cap=4, step_t0_s=0.1), (1, 2, 4, 8, 16), id="cap4-flat"),
    pytest.param(
        ServiceCurve(batch_cap=3, step_t0_s=0.08, step_k_s=0.02), (1, 2, 4, 8), id="cap3-growing-step"
    ),
    pytest.param(
        ServiceCurve(batch_cap=8, step_t0_s=0.06, step_k_s=0.02), (1, 2, 4, 8, 16), id="cap8-growing-step"
    ),
    pytest.param(
        ServiceCurve(batch_cap=4, step_t0_s=0.05, step_k_s=0.03), (1, 2, 4, 8), id="cap4-steep-step"
    ),
]


def position(levels: tuple[int, ...], c: float) -> float:
    """Fractional index of concurrency c among the (log-spaced) levels."""
    logs = [math.log2(v) for v in levels]
    x = math.log2(c)
    for i in range(len(levels) - 1):
        if logs[i] <= x <= logs[i + 1]:
            return i + (x - logs[i]) / (logs[i + 1] - logs[i])
    return 0.0 if x < logs[0] else len(levels) - 1.0


@pytest.mark.slow
@pytest.mark.parametrize(("curve", "levels"), CONFIGS)
def test_knees_within_one_level_of_analytic(curve: ServiceCurve, levels: tuple[int, ...]) -> None:
    want_thr, want_lat = analytic_knees(curve, levels)
    assert want_thr is not None and want_lat is not None  # each configuration saturates in range
    report = sweep_simulator(curve, levels)
    knees = report["knees"]
    got_thr, got_lat = knees["throughput"]["concurrency"], knees["latency"]["concurrency"]
    assert got_thr is not None, knees["throughput"]["reason"]
    assert got_lat is not None, knees["latency"]["reason"]
    assert abs(position(levels, got_thr) - levels.index(want_thr)) <= 1, (got_thr, want_thr)
    assert abs(position(levels, got_lat) - levels.index(want_lat)) <= 1, (got_lat, want_lat)
    rec = report["recommendation"]
    assert rec["concurrency_per_replica"] == max(1, math.floor(0.75 * min(got_thr, got_lat)))


@pytest.mark.slow
def test_no_knee_when_cap_above_tested_range() -> None:
    curve = ServiceCurve(batch_cap=64, step_t0_s=0.1, step_k_s=0.0005)
    levels = (1, 2, 4, 8)
    assert analytic_knees(curve, levels) == (None, None)
    report = sweep_simulator(curve, levels)
    assert report["knees"]["throughput"]["concurrency"] is None
    assert "no knee within the tested range" in report["knees"]["throughput"]["reason"]
    assert report["knees"]["latency"]["concurrency"] is None
    assert report["knees"]["latency"]["status"] == "none"
    assert report["recommendation"]["concurrency_per_replica"] is None
    assert all(lv["valid"] for lv in report["levels"])
