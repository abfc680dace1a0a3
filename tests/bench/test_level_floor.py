"""--min-duration-per-level: a level runs its request count *and* at least the floor, at full concurrency."""

import pytest
from benchkit import sweep_simulator
from pydantic import ValidationError

from plimsoll.bench.config import BenchConfig
from plimsoll.bench.simulator import ServiceCurve

CURVE = ServiceCurve(batch_cap=4, step_t0_s=0.01)


def test_a_floor_keeps_each_level_running_past_its_count() -> None:
    report = sweep_simulator(
        CURVE, (1, 2), duration_per_level_s=None, requests_per_level=2, min_duration_per_level_s=0.6
    )
    assert report["workload"]["min_duration_per_level_s"] == 0.6
    for level in report["levels"]:
        # The window closes only after both the count and the floor: its length is at least the floor.
        assert level["duration_s"] >= 0.6, level
        assert level["requests"]["measured"] >= 2


def test_without_a_floor_a_level_stops_at_its_count() -> None:
    report = sweep_simulator(CURVE, (1, 2), duration_per_level_s=None, requests_per_level=3)
    assert [lv["requests"]["measured"] for lv in report["levels"]] == [3, 3]


def test_a_floor_with_a_fixed_duration_is_refused() -> None:
    with pytest.raises(ValidationError, match="pass one of them"):
        BenchConfig(url="http://127.0.0.1:1", duration_per_level_s=5, min_duration_per_level_s=60)
