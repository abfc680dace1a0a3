"""ProfileDrift end to end without a cluster: a real profile, a replica that slows mid-run, a re-profile.

The replica is bench's simulator (real HTTP, the runtime's metric names), the
profile a real ``bench sweep`` report read by the operator's own reader, the
traffic bench's closed-loop generator, and the live side the operator's own
scrape parser and :class:`DriftTracker`, ticked every half second. The
simulator's step cost is switched to four times its value mid-run
(``PUT /sim/step-cost``): the replica must drift, and match again once a sweep
of the slowed replica is the profile. The factor and the margin are far apart
(×4 against 50%), so a busy CPU, which slows profile and traffic alike, does
not decide the outcome.
"""

import asyncio
from typing import Any

import httpx

from plimsoll.bench.client import OpenAIClient
from plimsoll.bench.config import BenchConfig, LengthSpec
from plimsoll.bench.loadgen import run_concurrency
from plimsoll.bench.session import BenchSession
from plimsoll.bench.simulator import ServiceCurve, serving_simulator
from plimsoll.bench.workload import Workload
from plimsoll.operator.scaling.drift import CurvePoint, DriftTracker, curve_from_status
from plimsoll.operator.scaling.metrics import parse_scrape
from plimsoll.operator.scaling.profile import CapacityProfile, read_profile

CURVE = ServiceCurve(batch_cap=4, step_t0_s=0.01, step_k_s=0.001)
# The traffic holds 4 in flight; the levels around it are what the tracker reads. Each level runs
# PROFILE_LEVEL_S: a profile's TTFT p95 over 1 s (~35 requests, its second-slowest) read 50.7 ms
# once in CI where the replica's own was 19.5 ms, a hiccup during the sweep, and the steady
# traffic then "drifted" from a profile that was off. ~100 requests a level make one hiccup a
# request in the tail, not its p95.
LEVELS = (2, 4, 8)
PROFILE_LEVEL_S = 3.0
WINDOW_S = 3.0
TICK_S = 0.5


def sim_config(url: str, levels: tuple[int, ...], seconds: float = 1.0) -> BenchConfig:
    return BenchConfig(
        url=url, model="sim-model", levels=levels, input_tokens=LengthSpec(value=16),
        output_tokens=LengthSpec(value=8), duration_per_level_s=seconds,
        max_client_lag_ms=1000.0, min_concurrency_ratio=0.8,
    )  # fmt: skip


async def profile_curve(url: str) -> tuple[CurvePoint, ...]:
    session = await BenchSession.open(sim_config(url, LEVELS, seconds=PROFILE_LEVEL_S))
    try:
        report = session.report("sweep", await session.sweep())
    finally:
        await session.aclose()
    profile = read_profile(report)
    assert isinstance(profile, CapacityProfile), profile
    return curve_from_status({"curve": profile.curve()})


notes: list[list[str]] = []  # what each tick compared, for a failure's message


async def watch(url: str, tracker: DriftTracker, seconds: float, clock: list[float]) -> list[Any]:
    """Tick the tracker for ``seconds``; the verdicts seen (clock[0] keeps time across calls)."""
    verdicts = []
    async with httpx.AsyncClient(base_url=url) as http:
        for _ in range(int(seconds / TICK_S)):
            await asyncio.sleep(TICK_S)
            clock[0] += TICK_S
            tracker.observe(clock[0], {"sim-0": parse_scrape((await http.get("/metrics")).text)})
            verdicts.append(tracker.verdict(clock[0]))
            notes.append([f"{c.sentence()} off={c.off()}" for c in tracker.latest.values()])
    return verdicts


def test_a_replica_that_slows_down_drifts_and_a_new_profile_clears_it() -> None:
    async def scenario() -> dict[str, Any]:
        async with serving_simulator(CURVE) as url:
            before = await profile_curve(url)
            cfg = sim_config(url, (4,), seconds=60.0)
            client = OpenAIClient(cfg, model="sim-model")
            load = asyncio.create_task(run_concurrency(client, Workload(cfg), cfg, 4))
            clock = [0.0]
            tracker = DriftTracker(curve=before, margin=0.5, window_s=WINDOW_S, min_requests=5)
            try:
                steady = await watch(url, tracker, 1.5 * WINDOW_S, clock)
                if load.done():
                    load.result()  # the traffic must still be running: raise what stopped it
                async with httpx.AsyncClient(base_url=url) as http:
                    await http.put("/sim/step-cost", json={"scale": 4.0})
                slowed = await watch(url, tracker, 2.5 * WINDOW_S, clock)
                # The re-profile, on the slowed replica with the traffic paused (a sweep beside
                # other clients would measure their load too).
                load.cancel()
                await asyncio.gather(load, return_exceptions=True)
                after = await profile_curve(url)
                load = asyncio.create_task(run_concurrency(client, Workload(cfg), cfg, 4))
                fresh = DriftTracker(curve=after, margin=0.5, window_s=WINDOW_S, min_requests=5)
                again = await watch(url, fresh, 1.5 * WINDOW_S, clock)
            finally:
                load.cancel()
                await asyncio.gather(load, return_exceptions=True)
                await client.aclose()
        return {"steady": steady, "slowed": slowed, "again": again, "before": before, "after": after}

    seen = asyncio.run(scenario())
    steady = [v.status for v in seen["steady"]]
    assert "True" not in steady and "False" in steady, notes[: len(steady)]
    drifted = [v for v in seen["slowed"] if v.status == "True"]
    assert drifted, [v.message for v in seen["slowed"]]
    assert drifted[0].reason == "BehaviourChanged" and "output tokens/s" in drifted[0].drifted[0].off()
    # Not before a window of off comparisons; the first of them already covers the slice (window / 5,
    # plus up to a tick) before the switch.
    first = seen["slowed"].index(drifted[0])
    assert (first + 1) * TICK_S >= WINDOW_S - WINDOW_S / 5 - TICK_S, first
    # The new profile saw the slower replica, and the replica matches it.
    assert seen["after"][-1].output_tokens_per_s < seen["before"][-1].output_tokens_per_s / 2
    again = [v.status for v in seen["again"]]
    assert "True" not in again and again[-1] == "False", notes[-len(again) :]
