"""The hold after the sweep steps down when the recommendation misses the SLO.

The simulator's service degrades above four running requests (every step four
times as long), so a recommendation of 8 misses a TPOT SLO the replica meets at
4. The SLO leaves 60 ms a token of room for client noise on a busy machine; the
degraded step misses it by 60 ms a token.
"""

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from benchkit import sim_config
from typer.testing import CliRunner

from plimsoll.bench.config import SLO, LengthSpec
from plimsoll.bench.session import BenchSession
from plimsoll.bench.simulator import ServiceCurve, running_simulator
from plimsoll.bench.verify import apply_verification, judge, step_down, verify
from plimsoll.cli import app
from plimsoll.operator.scaling.profile import CapacityProfile, profile_conditions, read_profile

DEGRADING = ServiceCurve(batch_cap=16, step_t0_s=0.04, degrade_above=4, degrade_factor=4.0)


async def hold_from(url: str, recommended: int) -> dict[str, Any]:
    cfg = sim_config(
        url,
        (1,),
        output_tokens=LengthSpec(value=6),
        slo=SLO(tpot_p50_ms=100.0),
        verify_seconds=1.5,
        scrape_interval_s=0.2,
    )
    session = await BenchSession.open(cfg)
    try:
        report = {"levels": [], "recommendation": {"concurrency_per_replica": recommended}}
        verification = await verify(session, report)
    finally:
        await session.aclose()
    assert verification is not None
    return verification


def test_step_down_and_judge_rules() -> None:
    assert [step_down(c) for c in (8, 6, 4, 2, 1)] == [6, 4, 3, 1, 1]
    window = {
        "start_s": 0.0, "end_s": 1.0, "finished": 100, "good": 90, "waiting_mean": 0.0,
        "met_slo": True, "broken": [],
    }  # fmt: skip
    # 90 of 100 requests within the bounds is fine when the window's percentiles meet the SLO.
    passed, attainment, _, why = judge([window, window, window], 8)
    assert passed is True and attainment == 1.0 and "270/300 requests" in why
    short = {**window, "met_slo": False, "broken": ["TTFT P95 700 > 600 ms"]}
    passed, attainment, _, why = judge([window, short, window], 8)
    assert passed is False and attainment == pytest.approx(2 / 3)
    assert "SLO attainment 66.7% < 99%" in why and "1 of 3 windows missed" in why and "TTFT P95 700" in why
    empty = {**short, "finished": 0, "good": 0}  # no request ended in it: not judged
    assert judge([window, empty, window], 8)[:2] == (True, 1.0)
    assert judge([empty, empty, empty], 8)[0] is False
    growing = [
        {**window, "waiting_mean": 0.0},
        {**window, "waiting_mean": 1.0},
        {**window, "waiting_mean": 3.0},
    ]
    passed, _, growth, why = judge(growing, 8)
    assert passed is False and growth == 3.0 and "queue grew by 3.0" in why


def test_window_percentiles_name_the_bound_they_break() -> None:
    from plimsoll.bench.client import RequestRecord
    from plimsoll.bench.verify import window_count, window_percentiles

    assert [window_count(s) for s in (1.5, 60, 600, 610)] == [3, 3, 10, 10]
    records = []
    for i in range(20):
        ttft = 0.1 if i < 18 else 2.0
        records.append(RequestRecord(i, 0.0, first_token=ttft, end=3.0, measured=True))
    values, broken = window_percentiles(records, SLO(ttft_p95_ms=500.0))
    assert values["ttft_p95"] > 500 and broken == [f"TTFT P95 {values['ttft_p95']:.0f} > 500 ms"]
    values, broken = window_percentiles(records[:18], SLO(ttft_p95_ms=500.0))
    assert values["ttft_p95"] == pytest.approx(100.0) and broken == []
    # One failure in 40 is a share below 5%: the p95 stays where the successes put it.
    fast = [RequestRecord(i, 0.0, first_token=0.1, end=1.0, measured=True) for i in range(39)]
    failed = RequestRecord(99, 0.0, end=1.0, error_kind="timeout", measured=True)
    values, broken = window_percentiles([*fast, failed], SLO(ttft_p95_ms=500.0))
    assert values["ttft_p95"] == pytest.approx(100.0) and broken == []
    # Four of ten failed: the p95 reaches into them and the window says so.
    _, broken = window_percentiles([*fast[:6], *[failed] * 4], SLO(ttft_p95_ms=500.0))
    assert broken == ["TTFT P95: 4 of 10 requests failed"]
    assert window_percentiles([*fast[:6], *[failed] * 4], SLO())[1] == ["4 of 10 requests failed"]


@pytest.mark.slow
def test_hold_steps_down_past_the_degradation_and_records_why() -> None:
    with running_simulator(DEGRADING) as url:
        verification = asyncio.run(hold_from(url, 8))
    tried = verification["tried"]
    assert [t["concurrency"] for t in tried] == [8, 6, 4], [(t["concurrency"], t["why"]) for t in tried]
    for miss in tried[:2]:
        assert miss["passed"] is False and miss["attainment"] < 0.99
        assert "attainment" in miss["why"] and "windows missed" in miss["why"] and "TPOT P50" in miss["why"]
    assert tried[2]["passed"] is True and tried[2]["attainment"] >= 0.99
    assert verification["verified_concurrency"] == 4
    assert verification["windows_measured"] == 3 * 3
    assert all(sum(w["finished"] for w in t["windows"]) > 0 for t in tried)

    # The report and the operator carry it: the verified concurrency is the recommendation.
    report = {
        "schema_version": "1.0",
        "knees": {"throughput": {"concurrency": 16}, "latency": {"concurrency": 11.0}},
        "recommendation": {
            "concurrency_per_replica": 8,
            "headroom": 0.75,
            "reason": "⌊0.75 × latency knee 11⌋ = 8",
        },
        "levels": [],
        "warnings": [],
    }
    verified = apply_verification(report, verification)
    assert verified["recommendation"]["concurrency_per_replica"] == 4
    assert verified["recommendation"]["swept_concurrency_per_replica"] == 8
    assert "stepped down to 4" in verified["recommendation"]["reason"]
    profile = read_profile(verified)
    assert isinstance(profile, CapacityProfile) and profile.concurrency_per_replica == 4
    status = profile.verification_status()
    assert status is not None
    assert status["verifiedConcurrency"] == 4 and status["windowsMeasured"] == 9
    assert [t["passed"] for t in status["tried"]] == [False, False, True]
    conditions, _ = profile_conditions(profile, "job", "sha256:x")
    assert "after stepping down from 8" in conditions[0][3]


@pytest.mark.slow
def test_sweep_cli_verifies_the_recommendation(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    with running_simulator(ServiceCurve(batch_cap=4, step_t0_s=0.04)) as url:
        result = CliRunner().invoke(
            app,
            ["bench", "sweep", "--url", url, "--levels", "1,2,4,8,12", "--input-tokens", "16",
             "--output-tokens", "6", "--duration-per-level", "0.8", "--verify-seconds", "1.5",
             "--max-client-lag-ms", "1000", "--min-concurrency-ratio", "0.8", "--output", str(out)],
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    v = report["verification"]
    assert v["swept_concurrency"] == report["recommendation"]["swept_concurrency_per_replica"]
    assert report["recommendation"]["concurrency_per_replica"] == v["verified_concurrency"]
    assert v["tried"][0]["concurrency"] == v["swept_concurrency"]
    assert v["windows_measured"] == 3 * len(v["tried"])
    # Without an SLO the hold is judged by the knee's own inflation limits.
    assert v["judged_by"].startswith("no SLO given")


def test_disturbed_windows_are_named_and_not_judged() -> None:
    from plimsoll.bench.verify import disturbance, inconclusive, reference_step_ms

    levels = [
        {"concurrency": c, "valid": True, "server": {"load": {"step_time_ms": ms}}}
        for c, ms in ((1, 40.0), (2, 44.0), (4, 60.0))
    ]
    assert reference_step_ms(levels, 2) == 44.0
    assert reference_step_ms(levels, 3) == pytest.approx(52.0)  # between the levels around it
    assert reference_step_ms(levels, 8) == 60.0 and reference_step_ms([], 2) is None
    assert disturbance(50.0, 44.0) is None  # within x1.3
    assert "129.0 ms against 44.0 ms" in (disturbance(129.0, 44.0) or "")
    assert disturbance(3.0, 1.0) is None  # x3 but only 2 ms: too small to call

    good = {"start_s": 0.0, "end_s": 60.0, "finished": 60, "good": 60, "waiting_mean": 0.1,
            "met_slo": True, "broken": [], "disturbed": None}  # fmt: skip
    busy = {**good, "start_s": 60.0, "met_slo": False, "broken": ["TTFT P95 650 > 600 ms"],
            "disturbed": "server step time 129.0 ms against 44.0 ms in the sweep at this concurrency"}  # fmt: skip
    passed, attainment, _, why = judge([good, busy, good, good], 2)
    assert passed is True and attainment == 1.0 and "1 disturbed window(s) not judged (60 s: server step" in why
    assert inconclusive([good, busy, good, good]) is None
    assert "busy in 3 of 4 windows" in (inconclusive([good, busy, busy, busy]) or "")


@pytest.mark.slow
def test_a_hold_on_a_busy_host_is_inconclusive_and_the_operator_says_so() -> None:
    """The simulator's steps turn 4x slower after the sweep (a neighbour on the host, as the
    server's own step time shows): the hold neither passes nor steps down."""
    import httpx

    async def run(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
        cfg = sim_config(
            url, (1, 2, 4), output_tokens=LengthSpec(value=6), slo=SLO(tpot_p50_ms=100.0),
            verify_seconds=1.5, scrape_interval_s=0.2,
        )  # fmt: skip
        session = await BenchSession.open(cfg)
        try:
            report = session.report("sweep", await session.sweep())
            report["recommendation"]["concurrency_per_replica"] = 2
            async with httpx.AsyncClient() as http:
                (await http.put(f"{url}/sim/step-cost", json={"scale": 4.0})).raise_for_status()
            verification = await verify(session, report)
        finally:
            await session.aclose()
        assert verification is not None
        return report, verification

    with running_simulator(ServiceCurve(batch_cap=16, step_t0_s=0.02)) as url:
        report, verification = asyncio.run(run(url))
    tried = verification["tried"]
    assert len(tried) == 1 and tried[0]["concurrency"] == 2, [t["why"] for t in tried]
    assert verification["verified_concurrency"] is None and verification["inconclusive"]
    assert tried[0]["windows_disturbed"] >= 2 and "inconclusive: the host was busy" in tried[0]["why"]
    out = apply_verification(report, verification)
    assert out["recommendation"]["concurrency_per_replica"] == 2  # the sweep's, kept and marked unverified
    assert "not verified" in out["recommendation"]["reason"]
    assert any("verification inconclusive at c=2" in w for w in out["warnings"])
    profile = read_profile(out)
    assert isinstance(profile, CapacityProfile)
    conditions, warning = profile_conditions(profile, "job", "sha256:x")
    assert conditions[0][2] == "ProfileDisturbed" and "not verified" in conditions[0][3]
    assert warning is not None and "the hold after the sweep" in warning
