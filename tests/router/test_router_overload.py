"""Who is overloaded, and a replica that stops answering: the router over simulator replica processes.

A replica's 429 with ``x-plimsoll-overload: replica`` is retried on another replica, so
the client never sees it while one has room; when none has, the client gets 429 with
``x-plimsoll-overload: service`` and ``Retry-After``. A replica that stops answering
(SIGSTOP: its connections stay open, nothing comes back) is found lost by its probes,
and the requests waiting on it do not wait forever.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
from router_harness import eventually, replica_metric, run_router

from plimsoll.router.proxy import REPLICA_HEADER

BODY = {"model": "fake", "prompt": "hi", "max_tokens": 10}


async def test_a_full_replica_is_retried_elsewhere_and_a_full_service_says_so(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    # Room for 2 on the first (1 running, 1 waiting), 8 on the second; round-robin sends each half.
    replicas = fake_replicas([{"batch_cap": 1, "max_waiting": 1, "step_t0_s": 0.1},
                              {"batch_cap": 4, "max_waiting": 4, "step_t0_s": 0.1}])  # fmt: skip
    urls = tuple(r.url for r in replicas)
    async with run_router(backends=urls, policy="round-robin", scrape_interval_s=60) as router, \
            httpx.AsyncClient(timeout=60) as client:  # fmt: skip

        async def post() -> httpx.Response:
            return await client.post(router.url + "/v1/completions", json=BODY)

        answers = await asyncio.gather(*(post() for _ in range(6)))
        assert [a.status_code for a in answers] == [200] * 6  # the small one's refusals went to the big one
        refused = replica_metric(replicas[0], "plimsoll_admission_rejections_total")
        assert refused >= 1
        assert router.metric("plimsoll_router_retries_total", replica=urls[0]) == refused
        answers = await asyncio.gather(*(post() for _ in range(14)))  # room for 10 at most
        codes = sorted(a.status_code for a in answers)
        assert set(codes) == {200, 429} and codes.count(200) >= 10 - 2, codes
        for answer in answers:
            if answer.status_code == 429:
                assert answer.headers["x-plimsoll-overload"] == "service"
                assert answer.headers["retry-after"] == "1"
        assert router.metric("plimsoll_router_rejections_total", reason="replicas_full") == codes.count(429)


async def test_requests_on_a_replica_that_stops_answering_do_not_wait_for_it(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    stopped, other = fake_replicas([{"step_t0_s": 0.3}, {}])
    async with run_router(backends=(stopped.url,), scrape_interval_s=0.2, scrape_timeout_s=0.5) as router, \
            httpx.AsyncClient(timeout=60) as client:  # fmt: skip
        plain = asyncio.create_task(
            client.post(router.url + "/v1/completions", json={**BODY, "max_tokens": 30})
        )
        events: list[str] = []

        async def stream() -> None:
            body = {**BODY, "max_tokens": 30, "stream": True}
            async with client.stream("POST", router.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)

        streaming = asyncio.create_task(stream())
        await eventually(lambda: bool(events), "the stream's first event")
        assert router.metric("plimsoll_router_replica_inflight", replica=stopped.url) == 2
        # Another replica joins (as discovery would add a pod), then the first stops answering.
        router.state.replica_set.replace([stopped.url, other.url])
        assert router.state.scraper is not None
        await router.state.scraper.scrape_all()
        os.kill(stopped.process.pid, signal.SIGSTOP)
        try:
            answer = await plain
            await streaming
        finally:
            os.kill(stopped.process.pid, signal.SIGCONT)
    # The plain request was waiting for its answer: sent again whole, to the other replica.
    assert answer.status_code == 200 and answer.headers[REPLICA_HEADER] == other.url
    assert router.metric("plimsoll_router_migrations_total", outcome="migrated") == 1
    # The stream had text but the simulator sends no token ids: it ends with an error event, not a hang.
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == 502 and "token ids" in error["message"]
    assert router.metric("plimsoll_router_migrations_total", outcome="unsupported") == 1
