"""Reading the bench report as the operator's capacity profile, and the hash that marks it stale."""

import json
from typing import Any

import pytest

from plimsoll.operator.scaling.profile import (
    CapacityProfile,
    ProfileFailure,
    is_stale,
    profile_spec_hash,
    read_profile,
)


def report(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "schema_version": 1,
        "knees": {"throughput": {"concurrency": 24, "tokens_per_s": 900.0}, "latency": {"concurrency": 16}},
        "recommendation": {"concurrency_per_replica": 12, "headroom": 0.75},
        "workload": {"input_tokens": 512, "output_tokens": 128},
        "levels": [{"concurrency": 1}],  # other fields are not the operator's business
    }
    base.update(overrides)
    return base


def test_valid_report_gives_the_capacity() -> None:
    p = read_profile(json.dumps(report()))
    assert isinstance(p, CapacityProfile)
    assert (p.throughput_knee, p.latency_knee, p.concurrency_per_replica) == (24, 16, 12)
    assert p.knees() == {"throughput": {"concurrency": 24}, "latency": {"concurrency": 16}}
    assert p.workload == {"input_tokens": 512, "output_tokens": 128}


def test_no_latency_knee_is_fine_when_there_is_a_recommendation() -> None:
    p = read_profile(report(knees={"throughput": {"concurrency": 8}, "latency": {"concurrency": None}}))
    assert isinstance(p, CapacityProfile) and p.latency_knee is None


@pytest.mark.parametrize(
    ("data", "reason", "words"),
    [
        ("{not json", "InvalidReport", "not JSON"),
        ("[1, 2]", "InvalidReport", "not an object"),
        (json.dumps({"schema_version": 1}), "InvalidReport", "knees"),
        (
            json.dumps(report(recommendation={"concurrency_per_replica": 0})),
            "InvalidReport",
            "concurrency_per_replica",
        ),
        (json.dumps(report(schema_version="2.0")), "UnsupportedReportVersion", "2.0"),
        (
            json.dumps(
                report(recommendation={"concurrency_per_replica": None, "reason": "no knee within range"})
            ),
            "NoRecommendation",
            "no knee within range",
        ),
    ],
)
def test_invalid_or_failed_reports_give_a_reason_never_a_capacity(data: str, reason: str, words: str) -> None:
    p = read_profile(data)
    assert isinstance(p, ProfileFailure)
    assert p.reason == reason
    assert words in p.message


def test_spec_hash_changes_with_what_was_measured_only() -> None:
    base = dict(model="pvc://m/qwen", image="plimsoll:0.1", engine_kind="plimsoll", engine_args=["--x", "1"])
    h = profile_spec_hash(**base, gpu={"count": 1, "type": "H100"})  # type: ignore[arg-type]
    assert h.startswith("sha256:") and len(h) == len("sha256:") + 16
    assert h == profile_spec_hash(**base, gpu={"type": "H100", "count": 1})  # type: ignore[arg-type]
    changed = {**base, "engine_args": ["--x", "2"]}
    h2 = profile_spec_hash(**changed, gpu={"count": 1, "type": "H100"})  # type: ignore[arg-type]
    assert h2 != h
    assert profile_spec_hash(**base, gpu={"count": 1, "type": "A100"}) != h  # type: ignore[arg-type]
    assert is_stale(h, h2) and not is_stale(h, h) and not is_stale(None, h)
