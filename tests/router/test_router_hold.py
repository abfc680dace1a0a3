"""The hold queue at zero replicas: bounded, released at the replica's pace, 429 and 503 that say why.

The router runs for real (uvicorn on 127.0.0.1) with a static backend whose port
has no process yet, so it sees zero ready replicas; a fake replica process is
then started on that port, as a pod would turn Ready after a scale-from-zero.
No test here waits on a timer except the one about the hold deadline itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import asdict
from typing import Any

import httpx
import pytest
from router_harness import REPLICA_DEFAULTS, run_router

from plimsoll.bench.simulator import ServiceCurve, SimulatorProcess, free_port
from plimsoll.router.hold import ColdStarts, HoldFull, HoldQueue, p95


def _start_replica(port: int, **fields: Any) -> SimulatorProcess:
    """The bench simulator on a port chosen before it existed (the router already points there)."""
    curve = ServiceCurve(**{**REPLICA_DEFAULTS, **fields})
    process = subprocess.Popen(
        [sys.executable, "-m", "plimsoll.bench.simulator", "--port", str(port), "--curve", json.dumps(asdict(curve))],
        env=dict(os.environ),
    )  # fmt: skip
    replica = SimulatorProcess(f"http://127.0.0.1:{port}", process)
    replica.wait_ready(timeout_s=60)
    return replica


async def _until(predicate, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def _completion(i: int, stream: bool = False) -> dict[str, object]:
    return {
        "model": REPLICA_DEFAULTS.get("model", "sim-model"),
        "prompt": f"held request {i}",
        "max_tokens": 8,
        "stream": stream,
    }


async def test_a_burst_of_200_at_zero_never_holds_more_than_the_bound() -> None:
    port = free_port()
    bound = 16
    config = dict(backends=(f"http://127.0.0.1:{port}",), hold_queue=bound, scrape_interval_s=0.1,
                  hold_timeout_s=600, cold_start_fallback_s=30)  # fmt: skip
    process = None
    try:
        async with run_router(**config) as router, httpx.AsyncClient(timeout=120) as client:
            hold = router.state.hold
            assert hold is not None
            # A holding router is Ready at zero replicas: it is what clients talk to while one starts.
            assert (await client.get(router.url + "/ready")).status_code == 200
            tasks = [asyncio.create_task(client.post(router.url + "/v1/completions", json=_completion(i)))
                     for i in range(200)]  # fmt: skip
            await _until(lambda: sum(t.done() for t in tasks) == 200 - bound and hold.held == bound,
                         "the burst to split into held and refused")  # fmt: skip
            refused = [t.result() for t in tasks if t.done()]
            assert {r.status_code for r in refused} == {429}
            for r in refused:
                assert int(r.headers["Retry-After"]) >= 1
                assert "router.holdQueue" in r.json()["error"]["message"]
            demand = (await client.get(router.url + "/hold")).json()
            assert demand["held"] == bound and demand["rejectedTotal"] == 200 - bound, demand
            assert router.metric("plimsoll_router_rejections_total", reason="hold_full") == 200 - bound

            process = _start_replica(port)
            answered = await asyncio.gather(*(t for t in tasks if not t.done()))
            assert [r.status_code for r in answered] == [200] * bound
            assert hold.max_held == bound, hold.max_held
            assert hold.held == 0 and hold.released_total == bound
    finally:
        if process is not None:
            process.kill()


async def test_held_requests_are_released_no_faster_than_the_replicas_concurrency() -> None:
    port = free_port()
    config = dict(backends=(f"http://127.0.0.1:{port}",), hold_queue=8, release_concurrency=2,
                  scrape_interval_s=0.1, hold_timeout_s=600)  # fmt: skip
    process = None
    try:
        async with run_router(**config) as router, httpx.AsyncClient(timeout=120) as client:
            hold = router.state.hold
            assert hold is not None

            async def streamed(i: int) -> tuple[int, str]:
                async with client.stream("POST", router.url + "/v1/completions",
                                         json=_completion(i, stream=True)) as response:  # fmt: skip
                    return response.status_code, (await response.aread()).decode()

            async def plain(i: int) -> tuple[int, str]:
                response = await client.post(router.url + "/v1/completions", json=_completion(i))
                return response.status_code, response.text

            tasks = [asyncio.create_task(streamed(i) if i % 2 else plain(i)) for i in range(6)]
            await _until(lambda: hold.held == 6, "six held requests")
            process = _start_replica(port, step_t0_s=0.05, batch_cap=16)
            results = await asyncio.gather(*tasks)
            assert [code for code, _ in results] == [200] * 6
            for i, (_, text) in enumerate(results):
                if i % 2:
                    assert text.rstrip().endswith("data: [DONE]"), text[-200:]
            # Never more than the verified concurrency (2 per ready replica, one replica) at once.
            assert hold.max_released_in_flight == 2, hold.max_released_in_flight
            assert hold.released_in_flight == 0
    finally:
        if process is not None:
            process.kill()


async def test_a_held_request_past_its_deadline_gets_503_saying_the_service_is_starting() -> None:
    port = free_port()
    async with run_router(backends=(f"http://127.0.0.1:{port}",), hold_queue=4, hold_timeout_s=1,
                          scrape_interval_s=0.1) as router, httpx.AsyncClient(timeout=60) as client:  # fmt: skip
        response = await client.post(router.url + "/v1/completions", json=_completion(0))
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        assert "the service is starting" in message and "held for" in message, message
        assert router.metric("plimsoll_router_rejections_total", reason="hold_timeout") == 1
        assert router.state.hold is not None and router.state.hold.held == 0


def test_retry_after_and_timeout_come_from_the_measured_cold_starts() -> None:
    cold = ColdStarts(fallback_s=60)
    assert not cold.measured and cold.p95_s == 60 and cold.hold_timeout_s(None) == 120
    cold.replace([10.0, 20.0, 30.0])
    assert p95(cold.samples) == 30.0
    assert cold.hold_timeout_s(None) == 60.0  # twice the p95
    assert cold.retry_after_s(waiting_for_s=12.0) == 18  # p95 less what this cold start already took
    assert cold.retry_after_s(waiting_for_s=45.0) == 1
    cold.replace([400.0])
    assert cold.hold_timeout_s(None) == 600.0  # capped
    assert cold.hold_timeout_s(5.0) == 5.0


async def test_a_full_queue_refuses_with_the_cold_start_basis() -> None:
    ready = 0
    hold = HoldQueue(1, lambda: ready, ColdStarts(samples=[42.0]))
    first = asyncio.create_task(hold.hold())
    await asyncio.sleep(0)
    with pytest.raises(HoldFull) as full:
        await hold.hold()
    assert full.value.retry_after_s == 42 and "p95 of 1 measured cold start(s) 42 s" in str(full.value)
    ready = 1
    hold.pump()
    assert await first >= 0 and hold.released_in_flight == 1
    hold.done()
    assert hold.released_in_flight == 0
