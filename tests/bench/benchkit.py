"""Shared helpers for the bench tests: sweeps against the simulator."""

import asyncio
from typing import Any

from plimsoll.bench.config import BenchConfig, LengthSpec
from plimsoll.bench.session import BenchSession
from plimsoll.bench.simulator import ServiceCurve, serving_simulator

# This machine's CPUs are shared; the gates stay on but with room for scheduler noise.
LENIENT = {"max_client_lag_ms": 1000.0, "min_concurrency_ratio": 0.8}


def sim_config(url: str, levels: tuple[int, ...], **overrides: Any) -> BenchConfig:
    fields: dict[str, Any] = {
        "url": url,
        "model": "sim-model",
        "levels": levels,
        "input_tokens": LengthSpec(value=16),
        "output_tokens": LengthSpec(value=4),
        "duration_per_level_s": 1.0,
        **LENIENT,
        **overrides,
    }
    return BenchConfig(**fields)


async def sweep(cfg: BenchConfig, kind: str = "sweep") -> tuple[dict[str, Any], BenchSession]:
    session = await BenchSession.open(cfg)
    try:
        levels = await session.sweep()
        return session.report(kind, levels), session
    finally:
        await session.aclose()


async def sweep_simulator_async(
    curve: ServiceCurve, levels: tuple[int, ...], **overrides: Any
) -> dict[str, Any]:
    async with serving_simulator(curve) as url:
        report, _ = await sweep(sim_config(url, levels, **overrides))
    return report


def sweep_simulator(curve: ServiceCurve, levels: tuple[int, ...], **overrides: Any) -> dict[str, Any]:
    return asyncio.run(sweep_simulator_async(curve, levels, **overrides))
