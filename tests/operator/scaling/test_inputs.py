"""From an LLMService spec to the autoscaler's configuration, starting size and profile hash."""

import math
from typing import Any

import pytest

from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.scaling.inputs import (
    autoscaler_config,
    per_replica_target,
    spec_profile_hash,
    starting_replicas,
)
from plimsoll.operator.scaling.sizing import NoTargetError


def spec(**extra: Any) -> LLMServiceSpec:
    body: dict[str, Any] = {"model": {"uri": "embedded://smollm2-135m"}, "scaling": {"min": 1, "max": 8}}
    body.update(extra)
    return LLMServiceSpec.model_validate(body)


def test_profile_target_and_spec_windows() -> None:
    cfg = autoscaler_config(
        spec(autoscaling={"scaleUpStabilizationSeconds": 15, "scaleDownStabilizationSeconds": 120}), 12
    )
    assert (cfg.target_per_replica, cfg.target_source) == (12, "profile")
    assert (cfg.min_replicas, cfg.max_replicas, cfg.scale_up_window_s, cfg.scale_down_window_s) == (
        1,
        8,
        15,
        120,
    )


def test_manual_and_override_precedence_and_no_made_up_target() -> None:
    manual = spec(capacity={"mode": "Manual", "concurrencyPerReplica": 5})
    assert per_replica_target(manual, 12).source == "manual"
    both = spec(
        capacity={"mode": "Manual", "concurrencyPerReplica": 5}, autoscaling={"targetInFlightPerReplica": 3}
    )
    assert per_replica_target(both, None).value == 3
    with pytest.raises(NoTargetError):
        per_replica_target(spec(), None)  # Profile mode, not measured yet


def test_expected_load_sizes_the_start() -> None:
    rate = spec(
        capacity={"mode": "Manual", "concurrencyPerReplica": 6},
        expectedLoad={"requestsPerSecond": 10, "avgLatencySeconds": 2},
    )
    result = starting_replicas(rate, None)
    assert result is not None and result.replicas == math.ceil(10 * 2 / 6) == 4
    assert starting_replicas(spec(), 6) is None
    big = spec(capacity={"mode": "Manual", "concurrencyPerReplica": 6}, expectedLoad={"concurrency": 600})
    result = starting_replicas(big, None)
    assert result is not None and (result.replicas, result.clamped_by) == (8, "max")


def test_profile_hash_follows_engine_args_and_gpu_not_scaling() -> None:
    base = spec_profile_hash(spec(), "plimsoll:1")
    assert base == spec_profile_hash(spec(scaling={"min": 2, "max": 3}), "plimsoll:1")
    assert base != spec_profile_hash(spec(engine={"args": ["--max-num-seqs", "8"]}), "plimsoll:1")
    assert base != spec_profile_hash(spec(resources={"gpu": {"count": 2}}), "plimsoll:1")
    assert base != spec_profile_hash(spec(), "plimsoll:2")
