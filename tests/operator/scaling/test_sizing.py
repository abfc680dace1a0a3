"""Initial replicas from expected load (Little's law for a rate) and where the per-replica target comes from."""

import math

import pytest
from pydantic import ValidationError

from plimsoll.operator.scaling.sizing import (
    ExpectedLoad,
    NoTargetError,
    PerReplicaTarget,
    initial_replicas,
    resolve_target,
)


def test_concurrency_divided_by_target_rounds_up() -> None:
    r = initial_replicas(ExpectedLoad(concurrency=50), PerReplicaTarget(12, "profile"), 1, 10)
    assert r.replicas == math.ceil(50 / 12) == 5
    assert r.clamped_by is None
    assert r.formula == "concurrency 50; ceil(50 / 12 per replica (profile)) = 5"


def test_rate_goes_through_littles_law() -> None:
    load = ExpectedLoad(requests_per_second=8, average_latency_s=2.5)  # L = λW = 20 in flight
    r = initial_replicas(load, PerReplicaTarget(6, "manual"), 1, 10)
    assert r.in_flight == 20
    assert r.replicas == math.ceil(20 / 6) == 4
    assert "Little's law: 8 req/s × 2.5 s = 20 in flight" in r.formula


@pytest.mark.parametrize(
    ("load", "lo", "hi", "expect", "bound"), [(100, 1, 3, 3, "max"), (1, 2, 8, 2, "min")]
)
def test_result_is_clamped_and_says_so(load: float, lo: int, hi: int, expect: int, bound: str) -> None:
    r = initial_replicas(ExpectedLoad(concurrency=load), PerReplicaTarget(6, "profile"), lo, hi)
    assert (r.replicas, r.clamped_by) == (expect, bound)
    assert r.unclamped == math.ceil(load / 6)
    assert f"clamped to {bound} {expect}" in r.formula


def test_expected_load_is_validated() -> None:
    with pytest.raises(ValidationError, match="not both"):
        ExpectedLoad(concurrency=4, requests_per_second=2, average_latency_s=1)
    with pytest.raises(ValidationError, match="Little's law"):
        ExpectedLoad(requests_per_second=2)
    with pytest.raises(ValidationError, match="needs concurrency"):
        ExpectedLoad()


def test_target_precedence_override_manual_profile() -> None:
    assert resolve_target(override=3, manual=5, profile=7) == PerReplicaTarget(3, "override")
    assert resolve_target(manual=5, profile=7) == PerReplicaTarget(5, "manual")
    assert resolve_target(profile=7) == PerReplicaTarget(7, "profile")
    with pytest.raises(NoTargetError, match=r"capacity\.mode: Manual"):
        resolve_target()
    with pytest.raises(NoTargetError, match="must be positive"):
        resolve_target(manual=0)
