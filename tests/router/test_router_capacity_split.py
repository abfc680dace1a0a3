"""The router's split under a closed loop follows each replica's measured capacity (real HTTP, simulated replicas).

Three simulator processes with their own service curves (a fast wide replica, a middling
one, a slow narrow one), each weighed as an LLMService's variants are: its concurrency
target and the requests/s it finishes there, the figures its profile records. Closed-loop
clients holding half the summed targets in flight send a fixed number of requests through
a real router; each replica's share of them must be its share of the summed capacity within
10 % (a percentage point for the smallest). The pick rule is fair queueing over the rates; only
its skip of a replica that holds its target above its share of in-flight depends on the host.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import httpx
from router_harness import run_router

from plimsoll.bench.simulator import ServiceCurve
from plimsoll.router.config import Policy

OUTPUT_TOKENS = 4
REQUESTS = 480
# name -> (batch cap = concurrency target, first step, step cost per running request)
CURVES = {"fast": (8, 0.010, 0.001), "middling": (4, 0.020, 0.004), "slow": (2, 0.040, 0.010)}


def capacity(cap: int, t0: float, k: float) -> float:
    """Requests/s one replica finishes at its cap: ``cap`` requests per ``OUTPUT_TOKENS`` steps."""
    return cap / (OUTPUT_TOKENS * ServiceCurve(batch_cap=cap, step_t0_s=t0, step_k_s=k).step_s(cap))


async def test_closed_loop_split_follows_measured_capacity_within_ten_percent(fake_replicas: Any) -> None:
    spawned = fake_replicas(
        [{"batch_cap": c, "step_t0_s": t0, "step_k_s": k} for c, t0, k in CURVES.values()]
    )
    names = {p.url: name for p, name in zip(spawned, CURVES, strict=True)}
    rates = {p.url: capacity(*CURVES[n]) for p, n in zip(spawned, CURVES, strict=True)}
    targets = {p.url: float(CURVES[n][0]) for p, n in zip(spawned, CURVES, strict=True)}
    async with run_router(backends=tuple(names), policy=Policy.LEAST_INFLIGHT) as router:
        replicas = router.state.replica_set
        replicas.set_weights(targets, rates)
        while not all(r.is_ready for r in replicas.replicas.values()):
            await asyncio.sleep(0.02)
        sent: collections.Counter[str] = collections.Counter()
        left = REQUESTS
        body = {"model": "fake", "prompt": "a b c d", "max_tokens": OUTPUT_TOKENS}

        async def client(http: httpx.AsyncClient) -> None:
            nonlocal left
            while left > 0:
                left -= 1
                response = await http.post(f"{router.url}/v1/completions", json=body)
                assert response.status_code == 200, response.text
                sent[names[response.headers["x-plimsoll-replica"]]] += 1

        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(client(http) for _ in range(int(sum(targets.values()) // 2))))
    assert sum(sent.values()) == REQUESTS
    total_rate = sum(rates.values())
    for url, name in names.items():
        share, want = sent[name] / REQUESTS, rates[url] / total_rate
        # Within 10 %, or a percentage point for the smallest share (5.7 % is 27 of 480 requests, and a
        # replica holding its target above its share of in-flight is skipped, which a busy host causes).
        assert abs(share - want) <= max(0.1 * want, 0.01), (name, sent, share, want)
