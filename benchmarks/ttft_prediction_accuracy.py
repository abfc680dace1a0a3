"""How close the TTFT predictor comes to measured TTFT on the simulator's known service curve.

The simulator predicts each request's TTFT as a replica does (``plimsoll.ttft_prediction``)
and says so in ``x-plimsoll-predicted-ttft-ms``; the client measures the first byte of a burst
that builds a queue. Prints each queued request's predicted and measured TTFT and the
relative errors (the target is within 20 %). Figures depend on the host's scheduling noise,
so this is a script, not a test.

    python benchmarks/ttft_prediction_accuracy.py [--repeats 3]
"""

import argparse
import asyncio
import time

import httpx

from plimsoll.bench.simulator import ServiceCurve, running_simulator
from plimsoll.ttft_prediction import PREDICTED_TTFT_HEADER

# Steps of 50 ms keep scheduling noise small against the quantities compared.
CURVE = ServiceCurve(batch_cap=2, step_t0_s=0.05, prefill_s_per_token=0.002)
SHAPES = [(40, 6), (60, 4), (20, 8), (50, 5), (30, 6), (60, 3), (25, 7), (45, 4)]


async def _one(http: httpx.AsyncClient, words: int, max_tokens: int) -> tuple[float, float]:
    body = {"model": "sim-model", "prompt": " ".join(["w"] * words), "max_tokens": max_tokens, "stream": True}
    sent = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body) as response:
        predicted = float(response.headers[PREDICTED_TTFT_HEADER]) / 1000
        first = None
        async for line in response.aiter_lines():  # to the end: leaving early would free the slot
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - sent
    assert first is not None, "no data line"
    return predicted, first


async def _burst(url: str) -> list[tuple[float, float]]:
    limits = httpx.Limits(max_connections=len(SHAPES), max_keepalive_connections=len(SHAPES))
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        # Open every connection first: a connection's set-up is not the server's TTFT.
        await asyncio.gather(*(http.get("/health") for _ in SHAPES))
        tasks = []
        for words, out in SHAPES:
            tasks.append(asyncio.create_task(_one(http, words, out)))
            await asyncio.sleep(0.03)  # arrivals in order, so each finds the ones before it queued
        return list(await asyncio.gather(*tasks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    worst = []
    for i in range(args.repeats):
        with running_simulator(CURVE) as url:
            results = asyncio.run(_burst(url))
        queued = [(p, m) for p, m in results if p >= 0.3]
        errors = [abs(p - m) / m for p, m in queued]
        pairs = ", ".join(f"{p * 1e3:.0f}/{m * 1e3:.0f}" for p, m in queued)
        print(f"run {i + 1}: {len(queued)} queued requests, predicted/measured ms: {pairs}")
        print(f"        relative error max {max(errors):.1%}, mean {sum(errors) / len(errors):.1%}")
        worst.append(max(errors))
    print(f"worst relative error over {args.repeats} runs: {max(worst):.1%} (target within 20%)")


if __name__ == "__main__":
    main()
