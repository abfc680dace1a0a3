"""Reading the bench report as the operator's capacity profile, and the hash that marks it stale."""

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from plimsoll.operator.scaling.profile import (
    CapacityProfile,
    ProfileFailure,
    is_stale,
    profile_conditions,
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


def dist(mean: float, p50: float, p95: float) -> dict[str, float]:
    return {"mean": mean, "p50": p50, "p90": p95, "p95": p95, "p99": p95}


def sweep_report() -> dict[str, Any]:
    """A sweep report shaped exactly as bench/report.schema.json demands (checked below)."""
    # concurrency: (TTFT p95 ms, TPOT p50 ms, E2E mean ms)
    measured = {1: (40, 10, 1300), 2: (45, 11, 1450), 4: (60, 12, 1600), 8: (120, 15, 2000),
                16: (400, 22, 3000), 32: (1500, 40, 6500)}  # fmt: skip
    levels = [
        {
            "concurrency": c, "rate": None, "valid": True, "invalid_reasons": [],
            "requests": {"measured": 64, "completed": 64, "failed": 0, "error_rate": 0.0, "errors_by_kind": {}},
            "throughput": {"requests_per_s": c / (e2e / 1000), "output_tokens_per_s": 128 * c / (e2e / 1000),
                           "total_tokens_per_s": 640 * c / (e2e / 1000)},
            "latency_ms": {"ttft": dist(ttft * 0.8, ttft * 0.7, ttft), "tpot": dist(tpot, tpot, tpot * 1.2),
                           "itl": dist(tpot, tpot, tpot * 1.3), "e2e": dist(e2e, e2e, e2e * 1.2)},
            "achieved_concurrency": c * 0.98, "client": {}, "server": None,
        }
        for c, (ttft, tpot, e2e) in measured.items()
    ]  # fmt: skip
    return {
        "schema_version": "1.0", "kind": "sweep", "created_at": "2026-11-29T13:00:00+00:00",
        "tool": {"name": "plimsoll-bench", "version": "0.1.0"},
        "server": {"url": "http://127.0.0.1:8000", "model": "m", "engine_family": "plimsoll"},
        "workload": {"endpoint": "completions", "input_tokens": "512", "output_tokens": "128"},
        "slo": {"ttft_p95_ms": 500, "tpot_p50_ms": None, "e2e_p95_ms": None},
        "levels": levels,
        "knees": {"throughput": {"concurrency": 16, "reason": "90% of max"},
                  "latency": {"concurrency": 18.5, "status": "found", "reason": "TTFT p95 crosses 500 ms"}},
        "recommendation": {"concurrency_per_replica": 12, "headroom": 0.75, "limited_by": "throughput",
                           "knee_concurrency": 16, "reason": "⌊0.75 × throughput knee 16⌋ = 12"},
        "warnings": [],
    }  # fmt: skip


def test_sample_report_matches_the_bench_schema() -> None:
    schema = json.loads((Path(__file__).resolve().parents[3] / "bench" / "report.schema.json").read_text())
    jsonschema.validate(sweep_report(), schema)


def test_concurrency_rederived_for_another_slo_and_latency_interpolated() -> None:
    p = read_profile(sweep_report())
    assert isinstance(p, CapacityProfile)
    assert p.concurrency_for()[0] == 12
    # TTFT p95 ≤ 150 ms: margin −0.2 at 8 (120 ms), +1.67 at 16 (400 ms); the bench's own rule
    # interpolates the crossing in log2 c: 2^(3 + 0.2 / 1.867) = 8.62, and ⌊0.75 × min(8.62, 16)⌋ = 6.
    assert p.concurrency_for(ttft_p95_ms=150) == (6, "⌊0.75 × latency knee 8.62⌋ = 6")
    # Only the headroom changes: the report's own knees (latency 18.5, throughput 16).
    assert p.concurrency_for(headroom=0.5) == (8, "⌊0.5 × throughput knee 16⌋ = 8")
    # A looser SLO is capped by the throughput knee: ⌊0.5 × 16⌋ = 8.
    assert p.concurrency_for(ttft_p95_ms=5000, headroom=0.5)[0] == 8
    with pytest.raises(ValueError, match="no measured level meets the SLO"):
        p.concurrency_for(ttft_p95_ms=10)
    # Mean E2E at 12: halfway between 2000 ms (c=8) and 3000 ms (c=16).
    assert p.mean_latency_s(12) == pytest.approx(2.5)
    assert p.mean_latency_s(0.5) == pytest.approx(1.3) and p.mean_latency_s(64) == pytest.approx(6.5)


def test_a_disturbed_profile_is_used_but_never_silently() -> None:
    disturbed = {
        "concurrency": 16,
        "disturbed": {"reasons": ["client lag: the load generator's event loop woke up to 80 ms late"]},
    }
    p = read_profile(report(levels=[{"concurrency": 1, "disturbed": {"reasons": []}}, disturbed]))
    assert isinstance(p, CapacityProfile) and p.concurrency_per_replica == 12
    assert p.disturbed == ("c=16: client lag: the load generator's event loop woke up to 80 ms late",)
    conditions, warning = profile_conditions(p, "chat-profile-1", "sha256:abc")
    profiled = dict((c[0], c) for c in conditions)["Profiled"]
    assert profiled[1:3] == ("True", "ProfileDisturbed")
    assert "c=16: client lag" in profiled[3] and warning is not None and "re-profile" in warning
    quiet = read_profile(report())
    assert isinstance(quiet, CapacityProfile)
    conditions, warning = profile_conditions(quiet, "chat-profile-1", "sha256:abc")
    assert conditions[0][2] == "ProfileMeasured" and warning is None


def test_verification_goes_to_status_capacity() -> None:
    verification = {
        "verified_concurrency": 9,
        "swept_concurrency": 12,
        "seconds": 60,
        "attainment": 0.995,
        "windows_measured": 12,
        "tried": [
            {
                "concurrency": 12,
                "passed": False,
                "attainment": 0.91,
                "why": "attainment 91.0% < 99%",
                "windows": [{}] * 6,
            },
            {
                "concurrency": 9,
                "passed": True,
                "attainment": 0.995,
                "why": "attainment 99.5%",
                "windows": [{}] * 6,
            },
        ],
    }
    p = read_profile(
        report(recommendation={"concurrency_per_replica": 9, "headroom": 0.75}, verification=verification)
    )
    assert isinstance(p, CapacityProfile)
    assert p.verification_status() == {
        "verifiedConcurrency": 9,
        "sweptConcurrency": 12,
        "holdSeconds": 60,
        "attainment": 0.995,
        "windowsMeasured": 12,
        "inconclusive": None,
        "tried": [
            {
                "concurrency": 12,
                "passed": False,
                "attainment": 0.91,
                "windows": 6,
                "why": "attainment 91.0% < 99%",
            },
            {"concurrency": 9, "passed": True, "attainment": 0.995, "windows": 6, "why": "attainment 99.5%"},
        ],
    }
    conditions, _ = profile_conditions(p, "job", "sha256:abc")
    assert "held 60 s at 9 after stepping down from 12, SLO attainment 99.5%" in conditions[0][3]
    # The status schema takes it (CRD generated from the model).
    from plimsoll.operator.api.status import CapacityStatus

    CapacityStatus.model_validate({"verification": p.verification_status(), "disturbedLevels": ["c=16: x"]})
