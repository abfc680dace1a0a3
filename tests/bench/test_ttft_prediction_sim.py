"""Admission by predicted TTFT on the simulator's known service curve (the predictor's accuracy
against measured TTFT is printed by benchmarks/ttft_prediction_accuracy.py).

The simulator predicts each request's TTFT as a replica does (``plimsoll.ttft_prediction``)
and says so in ``x-plimsoll-predicted-ttft-ms``; the client measures the first byte.
Steps of 50 ms keep scheduling noise small against the quantities compared.
"""

import asyncio
import time

import httpx
import pytest

from plimsoll.bench.simulator import ServiceCurve, running_simulator
from plimsoll.ttft_prediction import PREDICTED_TTFT_HEADER, SLO_TTFT_HEADER

CURVE = ServiceCurve(batch_cap=2, step_t0_s=0.05, prefill_s_per_token=0.002)
pytestmark = pytest.mark.slow


async def _one(
    http: httpx.AsyncClient, words: int, max_tokens: int, headers: dict[str, str]
) -> tuple[int, float, float]:
    body = {"model": "sim-model", "prompt": " ".join(["w"] * words), "max_tokens": max_tokens, "stream": True}
    sent = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        predicted = float(response.headers[PREDICTED_TTFT_HEADER]) / 1000
        if response.status_code != 200:
            await response.aread()
            return response.status_code, predicted, time.perf_counter() - sent
        first = None
        async for line in response.aiter_lines():  # to the end: leaving early would free the slot
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - sent
    assert first is not None, "no data line"
    return 200, predicted, first


async def _burst(
    url: str, shapes: list[tuple[int, int]], headers: dict[str, str]
) -> list[tuple[int, float, float]]:
    limits = httpx.Limits(max_connections=len(shapes), max_keepalive_connections=len(shapes))
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        # Open every connection first: a connection's set-up is not the server's TTFT.
        await asyncio.gather(*(http.get("/health") for _ in shapes))
        tasks = []
        for words, out in shapes:
            tasks.append(asyncio.create_task(_one(http, words, out, headers)))
            await asyncio.sleep(0.03)  # arrivals in order, so each finds the ones before it queued
        return list(await asyncio.gather(*tasks))


def test_a_request_predicted_to_miss_its_bound_is_refused_at_once_with_retry_after() -> None:
    shapes = [(40, 20)] * 4 + [(40, 4)]
    with running_simulator(CURVE) as url:
        results = asyncio.run(_burst(url, shapes, {SLO_TTFT_HEADER: "400"}))
    statuses = [s for s, _, _ in results]
    assert statuses[:2] == [200, 200]  # two slots free: predicted well within 400 ms
    refused = [(p, m) for s, p, m in results if s == 429]
    assert refused and all(p > 0.4 for p, _ in refused)
    # A refusal takes no queue time: it is answered before any admitted request's first token
    # (each admitted one waits at least its prefill), whatever the host's speed.
    first_admitted = min(m for s, _, m in results if s == 200)
    assert all(m < first_admitted + 0.03 * len(shapes) for _, m in refused), results
