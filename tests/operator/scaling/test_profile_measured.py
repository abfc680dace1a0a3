"""status.capacity.measured: what a profile measured, read from the bench report."""

from plimsoll.operator.scaling.profile import CapacityProfile, read_profile


def _level(c: int, n: int, seconds: float, valid: bool = True) -> dict[str, object]:
    return {"concurrency": c, "valid": valid, "duration_s": seconds, "requests": {"measured": n}}


def test_measured_lists_each_level_and_the_totals() -> None:
    report = {
        "schema_version": "1.0",
        "knees": {"throughput": {"concurrency": 4}, "latency": {"concurrency": None}},
        "recommendation": {"concurrency_per_replica": 3},
        "workload": {"requests_per_level": None, "min_duration_per_level_s": 60},
        "levels": [_level(2, 100, 61.04), _level(1, 100, 75.5), _level(4, 104, 60.2, valid=False)],
    }
    profile = read_profile(report)
    assert isinstance(profile, CapacityProfile)
    assert profile.measured() == {
        "levels": [
            {"concurrency": 1, "requests": 100, "seconds": 75.5, "valid": True},
            {"concurrency": 2, "requests": 100, "seconds": 61.0, "valid": True},
            {"concurrency": 4, "requests": 104, "seconds": 60.2, "valid": False},
        ],
        "requests": 304,
        "seconds": 196.7,
        "requestsPerLevel": "max(100, 4 × concurrency)",
        "minSecondsPerLevel": 60,
    }
