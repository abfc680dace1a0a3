"""Replicas that go away: a request waits for one to come back, and a slow replica is not taken for a dead one.

Real processes: bench-simulator replicas on 127.0.0.1 (SIGKILLed as a crashed pod dies, started
again on the same address as its restarted container) behind an in-loop router.

* Every replica gone at once: a request sent then waits (``--migration-wait``) and completes once
  one is back; with none back within the wait it gets 503 with ``Retry-After``, never a 502.
* Probes that time out while the replica's stream keeps sending tokens (a replica too busy to
  answer its probes) do not make it lost; the same replica frozen (SIGSTOP) is lost once it has
  been silent for ``LOST_SILENCE_S``, and its stream's leg ends.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from urllib.parse import urlsplit

import httpx
from router_harness import REPLICA_DEFAULTS, eventually, run_router

from plimsoll.bench.simulator import ServiceCurve, spawn_simulator
from plimsoll.router import backends

COMPLETION = {"model": "fake", "prompt": "hello", "max_tokens": 4}


async def test_a_request_waits_while_every_replica_restarts_then_503_not_502(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    a, b = fake_replicas([{}, {}])
    urls = (a.url, b.url)
    patient = run_router(backends=urls, scrape_interval_s=0.05, migration_wait_s=120)
    brief = run_router(backends=urls, scrape_interval_s=0.05, migration_wait_s=0.5)
    restarted = None
    async with patient as waits, brief as gives_up, httpx.AsyncClient(timeout=120) as client:
        for router in (waits, gives_up):
            await eventually(lambda r=router: len(r.state.replica_set.ready()) == 2, "both replicas ready")
        a.kill()
        b.kill()
        # Sent at once: the router may still count them ready (its connects are refused) or already
        # not (its probes were); either way it waits for a replica rather than answering.
        pending = asyncio.create_task(client.post(waits.url + "/v1/completions", json=COMPLETION))
        await eventually(lambda: not waits.state.replica_set.ready(), "both replicas found gone")
        await asyncio.sleep(0.2)  # a few more probes of nothing
        assert not pending.done()
        restarted = spawn_simulator(ServiceCurve(**REPLICA_DEFAULTS), port=urlsplit(a.url).port)
        try:
            answer = await pending
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-plimsoll-replica"] == a.url
            await eventually(
                lambda: len(gives_up.state.replica_set.ready()) == 1, "the restarted replica ready"
            )
            restarted.kill()
            # No replica back within --migration-wait 0.5: a 503 the client may retry, not a 502.
            refused = await client.post(gives_up.url + "/v1/completions", json=COMPLETION)
        finally:
            restarted.kill()
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert "within --migration-wait 0.5 s" in refused.json()["error"]["message"]
    assert gives_up.metric("plimsoll_router_rejections_total", reason="no_replica") == 1


async def test_a_busy_replica_is_not_lost_but_a_frozen_one_is(fake_replicas, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(backends, "LOST_SILENCE_S", 1.5)
    (replica,) = fake_replicas([{"step_t0_s": 0.05}])
    body = {**COMPLETION, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with (
        run_router(backends=(replica.url,), scrape_interval_s=0.05, migration_wait_s=1) as router,
        httpx.AsyncClient(timeout=120) as client,
    ):
        seen = router.state.replica_set.replicas[replica.url]
        await eventually(lambda: seen.is_ready, "the replica ready")
        tokens = 0
        events: list[str] = []

        async def read() -> None:
            nonlocal tokens
            async with client.stream("POST", router.url + "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        tokens += 1

        stream = asyncio.create_task(read())
        await eventually(lambda: tokens >= 2, "the stream under way")
        # Every probe now times out, as a replica's too busy to answer does; its tokens still come.
        assert router.state.scraper is not None
        router.state.scraper._timeout = httpx.Timeout(1e-9)
        failing_since = time.monotonic()
        await eventually(
            lambda: (
                seen.probe_failures >= backends.LOST_AFTER_SILENT_PROBES
                and time.monotonic() - failing_since > 2 * backends.LOST_SILENCE_S
            ),
            "probes unanswered for longer than the silence that makes a replica lost",
        )
        assert not seen.lost and not seen.last_refused and not stream.done()
        before = tokens
        os.kill(replica.process.pid, signal.SIGSTOP)  # frozen: no probe answer, no token
        try:
            await eventually(lambda: seen.lost, "the frozen replica found lost")
            await stream
        finally:
            os.kill(replica.process.pid, signal.SIGCONT)
    assert (
        before >= 2
        and router.metric("plimsoll_router_upstream_errors_total", replica=replica.url, kind="stream_broken")
        == 1
    )
    assert '"error"' in events[-1]  # the simulator sends no token ids: its stream ends with an error event


def test_lost_rule_refused_fast_silent_slow() -> None:
    """The rule itself, on explicit times: refusals count at once, timeouts only after silence."""
    replica_set = backends.ReplicaSet.static(["http://dead", "http://busy", "http://gone"])
    dead, busy, gone = (replica_set.replicas[u] for u in ("http://dead", "http://busy", "http://gone"))
    calls: list[str] = []
    for replica in (dead, busy, gone):
        replica.heard(now=100.0)
        replica.lost_listeners.add(lambda u=replica.url: calls.append(u))
    for t in (101.0, 102.0):
        replica_set.record_probe(dead, answered=False, refused=True, now=t)
    assert dead.lost and calls == ["http://dead"]
    for t in range(101, 121):  # twenty timed-out probes, but a token every second
        busy.heard(now=t - 0.5)
        replica_set.record_probe(busy, answered=False, now=float(t))
    assert not busy.lost
    for t in (101.0, 102.0, 111.0):
        replica_set.record_probe(gone, answered=False, now=t)
    assert gone.lost and calls == ["http://dead", "http://gone"]
    replica_set.record_probe(gone, answered=True, now=112.0)
    assert not gone.lost and gone.probe_failures == 0
