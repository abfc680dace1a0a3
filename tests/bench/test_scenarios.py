"""Scenario recipes and validity gates against the in-process simulator (real HTTP)."""

import asyncio
from typing import Any

import pytest
from benchkit import sim_config

from plimsoll.bench.client import BenchError
from plimsoll.bench.config import LengthSpec
from plimsoll.bench.scenarios import Windows, rate_levels, run_baseline, run_burst, run_soak
from plimsoll.bench.session import BenchSession
from plimsoll.bench.simulator import ServiceCurve, serving_simulator


async def with_session(curve: ServiceCurve, body: Any, **overrides: Any) -> Any:
    async with serving_simulator(curve) as url:
        session = await BenchSession.open(sim_config(url, (1,), **overrides))
        try:
            return await body(session)
        finally:
            await session.aclose()


async def test_baseline_tpot_is_stable_on_a_steady_server() -> None:
    report = await with_session(
        ServiceCurve(step_t0_s=0.03),
        run_baseline,
        requests_per_level=6,
        duration_per_level_s=None,
        warmup_requests=1,
        output_tokens=LengthSpec(value=6),
    )
    assert report["kind"] == "baseline"
    assert report["scenario"]["tpot_variation"] is not None
    assert report["levels"][0]["requests"]["completed"] == 6
    assert report["recommendation"]["concurrency_per_replica"] is None


async def test_burst_reports_recovery_time() -> None:
    async def body(session: BenchSession) -> dict[str, Any]:
        return await run_burst(session, steady_rate=4, burst_requests=12, before_s=1.0, after_s=3.0)

    report = await with_session(ServiceCurve(batch_cap=4, step_t0_s=0.05), body)
    sc = report["scenario"]
    assert sc["burst_ttft_max_ms"] > 2 * sc["baseline_ttft_p50_ms"]  # 12 requests on 4 slots queue up
    assert sc["recovered"] and 0 <= sc["recovery_s"] < 3.0


async def test_soak_records_windows_and_drift() -> None:
    async def body(session: BenchSession) -> dict[str, Any]:
        return await run_soak(session, Windows(concurrency=2, duration_s=1.5, window_s=0.5))

    report = await with_session(
        ServiceCurve(step_t0_s=0.03), body, warmup_requests=0, duration_per_level_s=0.5
    )
    assert [lv["window_index"] for lv in report["levels"]] == [0, 1, 2]
    assert set(report["scenario"]["drift"]) >= {"ttft_p95", "kv_usage_mean"}
    assert all(lv["server"]["kv_usage"] is not None for lv in report["levels"])


async def test_open_loop_rate_measures_achieved_rate() -> None:
    async def body(session: BenchSession) -> dict[str, Any]:
        return await rate_levels(session, [5.0], "poisson", 0.5, warmup_s=0.3, max_concurrency=None)

    report = await with_session(ServiceCurve(step_t0_s=0.02), body, duration_per_level_s=1.5)
    lv = report["levels"][0]
    assert lv["rate"] == 5.0 and lv["concurrency"] is None
    assert lv["requests"]["measured"] > 0 and "saturated" in lv


async def test_error_gate_invalidates_levels_and_refuses_a_zero_report() -> None:
    # error_rate 0.4 with seed 0: the three pre-flight probes draw 0.84, 0.76, 0.42 and pass; then ~40% fail.
    async def body(session: BenchSession) -> dict[str, Any]:
        levels = await session.sweep()
        assert all(not lv["valid"] and "error rate" in " ".join(lv["invalid_reasons"]) for lv in levels)
        return session.report("sweep", levels)

    with pytest.raises(BenchError, match="no valid level"):
        await with_session(ServiceCurve(error_rate=0.4, step_t0_s=0.01), body, duration_per_level_s=0.5)


def test_overloaded_client_gate() -> None:
    async def body(session: BenchSession) -> dict[str, Any]:
        return await session.level(1)

    lv = asyncio.run(
        with_session(ServiceCurve(step_t0_s=0.01), body, max_client_lag_ms=1e-6, duration_per_level_s=0.3)
    )
    assert not lv["valid"] and "client overloaded" in " ".join(lv["invalid_reasons"])
