"""The router under concurrent load: a slow replica gets less work, a killed replica fails only its own streams."""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass

import openai
import pytest
from router_harness import run_router

from plimsoll.router.proxy import REPLICA_HEADER


async def drive(url: str, total: int, concurrency: int, **create: object) -> collections.Counter[str]:
    """Send `total` completions with `concurrency` workers; count which replica served each."""
    api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    served: collections.Counter[str] = collections.Counter()
    todo = iter(range(total))

    async def worker() -> None:
        for _ in todo:
            raw = await api.completions.with_raw_response.create(model="fake", **create)  # type: ignore[call-overload]
            raw.parse()
            served[raw.headers[REPLICA_HEADER]] += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await api.close()
    return served


@pytest.mark.slow
async def test_least_inflight_sends_a_slow_replica_fewer_requests(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    """Must-show 2: one replica 10x slower per token gets clearly fewer requests under least in-flight."""
    replicas = fake_replicas([{"step_t0_s": 0.05}, {"step_t0_s": 0.005}, {"step_t0_s": 0.005}])
    slow, fast = replicas[0].url, [r.url for r in replicas[1:]]
    async with run_router(backends=tuple(r.url for r in replicas), policy="least-in-flight",
                          scrape_interval_s=0.2) as router:
        served = await drive(router.url, total=60, concurrency=6, prompt="hello", max_tokens=10)
    print(f"least-inflight split: slow={served[slow]} fast={[served[u] for u in fast]}")
    assert sum(served.values()) == 60
    assert served[slow] < min(served[u] for u in fast)
    # Round-robin would give the slow replica 20 of 60; least in-flight must do clearly better.
    assert served[slow] <= 0.6 * (60 / 3)
    assert router.metric("plimsoll_router_routing_decisions_total", policy="least_inflight",
                         reason="least_inflight", lane="all") == 60


@dataclass
class Outcome:
    sent_at: float
    replica: str | None = None
    first_chunk_at: float | None = None
    ok: bool = False
    error: str = ""


@pytest.mark.slow
async def test_killing_a_replica_fails_only_its_running_streams(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    """Must-show 3: SIGKILL one replica mid-load; requests not yet on it succeed elsewhere.

    With in-flight migration off (``--migration-limit 0``): what a failure costs without it.
    """
    replicas = fake_replicas([{"step_t0_s": 0.02}] * 3)
    victim = replicas[0]
    # A long scrape interval: the router must learn of the death from the failures
    # themselves (broken streams, refused connects), not from a lucky probe.
    async with run_router(backends=tuple(r.url for r in replicas), policy="round-robin",
                          scrape_interval_s=60, migration_limit=0) as router:
        api = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60)
        outcomes: list[Outcome] = []
        stop_at = time.monotonic() + 3.5

        async def one_stream() -> None:
            outcome = Outcome(sent_at=time.monotonic())
            outcomes.append(outcome)
            try:
                raw = await api.completions.with_raw_response.create(
                    model="fake", prompt="tell me a story", max_tokens=40, stream=True)
                outcome.replica = raw.headers[REPLICA_HEADER]
                async for _ in raw.parse():
                    outcome.first_chunk_at = outcome.first_chunk_at or time.monotonic()
                outcome.ok = True
            except openai.APIError as exc:
                outcome.error = str(exc)

        async def worker() -> None:
            while time.monotonic() < stop_at:
                await one_stream()

        workers = [asyncio.create_task(worker()) for _ in range(9)]
        await asyncio.sleep(1.2)
        killed_at = time.monotonic()
        victim.kill()
        await asyncio.gather(*workers)
        await api.close()

    failed = [o for o in outcomes if not o.ok]
    after_kill = [o for o in outcomes if o.sent_at > killed_at]
    print(f"{len(outcomes)} streams, {len(failed)} failed, {len(after_kill)} sent after the kill, "
          f"retries={router.metric('plimsoll_router_retries_total', replica=victim.url)}")
    assert failed, "the kill should have broken the streams running on the victim"
    for outcome in failed:
        # Started on the victim before the kill: either its stream broke, or (a narrow
        # window) it was sent but the answer's headers had not come back yet, which the
        # router reports as a 502 naming the victim rather than replaying it.
        assert outcome.sent_at < killed_at, outcome
        assert outcome.replica == victim.url or victim.url in outcome.error, outcome
    assert len(after_kill) >= 5 and all(o.ok for o in after_kill)
    assert all(o.replica != victim.url for o in after_kill)
    broken = router.metric("plimsoll_router_upstream_errors_total", replica=victim.url, kind="stream_broken")
    unanswered = router.metric("plimsoll_router_upstream_errors_total", replica=victim.url, kind="read")
    # Every failure is counted against the victim, as a broken stream or an unanswered
    # request (which of the two depends on how far each had got when the kill landed).
    assert broken + unanswered == len(failed)


async def test_a_vllm_replica_is_probed_on_health_and_its_queue_read(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    """A vLLM replica has no /ready and spells its gauges vllm:*; the router still sees it and its queue."""
    replicas = fake_replicas([{"engine": "vllm", "batch_cap": 1, "step_t0_s": 0.05},
                              {"engine": "plimsoll"}])
    vllm_url = replicas[0].url
    async with run_router(backends=tuple(r.url for r in replicas), scrape_interval_s=0.1) as router:
        assert len(router.state.replica_set.ready()) == 2
        api = openai.AsyncOpenAI(base_url=replicas[0].url + "/v1", api_key="x", max_retries=0)
        # Queue work directly on the vLLM replica, behind the router's back.
        direct = [asyncio.create_task(api.completions.create(model="fake", prompt="x", max_tokens=20))
                  for _ in range(4)]
        vllm_replica = router.state.replica_set.replicas[vllm_url]
        deadline = time.monotonic() + 10
        while not vllm_replica.waiting:
            assert time.monotonic() < deadline, "the vLLM replica's waiting queue was never scraped"
            await asyncio.sleep(0.05)
        assert vllm_replica.engine == "vllm" and vllm_replica.running == 1
        # Least in-flight now avoids it although the router itself sent it nothing.
        served = await drive(router.url, total=4, concurrency=1, prompt="y", max_tokens=1)
        assert served == {replicas[1].url: 4}
        await asyncio.gather(*direct)
        await api.close()


async def test_length_lanes_keep_long_requests_off_the_short_lane(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    replicas = fake_replicas([{"step_t0_s": 0.001}] * 3)
    long_lane = sorted(r.url for r in replicas)[-1]
    async with run_router(backends=tuple(r.url for r in replicas),
                          lanes={"long_request_tokens": 100, "long_lane_replicas": 1}) as router:
        long_served, short_served = await asyncio.gather(
            drive(router.url, total=6, concurrency=3, prompt="write an essay", max_tokens=150),
            drive(router.url, total=12, concurrency=3, prompt="hi", max_tokens=3),
        )
    assert long_served == {long_lane: 6}
    assert long_lane not in short_served and sum(short_served.values()) == 12
    assert router.metric("plimsoll_router_routing_decisions_total", policy="least_inflight",
                         reason="least_inflight", lane="long") == 6
