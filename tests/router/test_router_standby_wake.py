"""The router wakes a parked replica itself when every awake one is past its target.

Real router (uvicorn on 127.0.0.1) and bench-simulator replicas in their own processes; the
parked one runs vLLM's sleep interface (asleep: /ready and generation answer 503; POST /wake_up
takes ``wake_s``) behind an admin key, as a plimsoll replica's is. The parked mark is set on the
replica set as discovery sets it from the pod's ``plimsoll.dev/standby`` label.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from router_harness import RunningRouter, eventually, fake_replicas, run_router  # noqa: F401

from plimsoll.router.backends import ReplicaSet
from plimsoll.router.metrics import RouterMetrics
from plimsoll.router.proxy import REPLICA_HEADER
from plimsoll.router.standby_wake import StandbyWaker

ADMIN = "admin-key-for-the-test"
# Long enough that the first requests are still running when the next ones arrive (5 ms a token).
LONG = {"model": "fake", "prompt": "hello", "max_tokens": 600, "stream": True}
SHORT = {"model": "fake", "prompt": "hello", "max_tokens": 4}


@contextlib.asynccontextmanager
async def streaming(http: httpx.AsyncClient) -> AsyncIterator[str]:
    """A long streamed answer under way (its first byte read); yields the replica it runs on."""
    response = await http.send(http.build_request("POST", "/v1/completions", json=LONG), stream=True)
    try:
        assert response.status_code == 200
        chunks = response.aiter_bytes()  # held: a dropped generator would close the stream
        await chunks.__anext__()
        yield response.headers[REPLICA_HEADER]
    finally:
        await response.aclose()


def _park(router: RunningRouter, url: str, pod: str) -> None:
    """What discovery does for a pod with the standby label."""
    router.state.replica_set.upsert(url, True, parked=True)
    router.state.replica_set.replicas[url].pod = pod


async def test_a_request_past_every_target_wakes_a_parked_replica_and_is_served_there(fake_replicas) -> None:  # noqa: F811
    awake, parked = fake_replicas([{"batch_cap": 8}, {"enable_sleep_mode": True, "start_asleep": True,
                                                      "wake_s": 0.2, "admin_key": ADMIN}])  # fmt: skip
    async with run_router(backends=(awake.url, parked.url), standby_wake_inflight=2, wake_api_key=ADMIN) as router:
        _park(router, parked.url, "pod-b")
        assert [r.url for r in router.state.replica_set.ready()] == [awake.url]
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
            async with streaming(http) as first, streaming(http) as second:
                # Two in flight on the one awake replica: at its target, nothing woken yet.
                assert first == second == awake.url
                assert router.metric("plimsoll_router_standby_wakes_total", outcome="woken") == 0
                third = await http.post("/v1/completions", json=SHORT)
                assert third.status_code == 200
                assert third.headers[REPLICA_HEADER] == parked.url  # it waited for the wake, not in the queue
                hold = (await http.get("/hold")).json()
            assert set(hold["wokenStandby"]) == {"pod-b"}
        state = httpx.get(f"{parked.url}/is_sleeping", timeout=5).json()
        assert state == {"is_sleeping": False, "wakes": 1}
        assert router.metric("plimsoll_router_standby_wakes_total", outcome="woken") == 1
        # The operator parks it again (the label stays, the replica sleeps): the router stops routing there.
        assert httpx.post(f"{parked.url}/sleep", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=5).is_success
        await router.state.scraper.scrape_all()  # type: ignore[union-attr]
        assert [r.url for r in router.state.replica_set.ready()] == [awake.url]
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as http:
            assert (await http.get("/hold")).json()["wokenStandby"] == {}


async def test_a_wake_the_replica_refuses_leaves_the_request_to_the_awake_replicas(fake_replicas) -> None:  # noqa: F811
    awake, parked = fake_replicas([{"batch_cap": 8}, {"enable_sleep_mode": True, "start_asleep": True,
                                                      "admin_key": ADMIN}])  # fmt: skip
    async with run_router(backends=(awake.url, parked.url), standby_wake_inflight=1, wake_api_key="wrong") as router:
        _park(router, parked.url, "pod-b")
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as http, streaming(http) as first:
            assert first == awake.url
            answer = await http.post("/v1/completions", json=SHORT)
            assert answer.status_code == 200 and answer.headers[REPLICA_HEADER] == awake.url
        assert router.metric("plimsoll_router_standby_wakes_total", outcome="failed") == 1
        assert httpx.get(f"{parked.url}/is_sleeping", timeout=5).json()["is_sleeping"] is True


async def test_without_a_target_the_router_wakes_nothing(fake_replicas) -> None:  # noqa: F811
    awake, parked = fake_replicas([{"batch_cap": 8}, {"enable_sleep_mode": True, "start_asleep": True}])
    async with run_router(backends=(awake.url, parked.url)) as router:
        _park(router, parked.url, "pod-b")
        async with (
            httpx.AsyncClient(base_url=router.url, timeout=30) as http,
            streaming(http), streaming(http), streaming(http),
        ):  # fmt: skip
            answer = await http.post("/v1/completions", json=SHORT)
            assert answer.headers[REPLICA_HEADER] == awake.url
        # The LLMService's status names the autoscaler's target: from then on the router wakes.
        router.state.take_status({"autoscaler": {"inputs": {"targetInFlightPerReplica": 1}}})
        assert router.state.waker is not None and router.state.waker.threshold == 1.0
        assert httpx.get(f"{parked.url}/is_sleeping", timeout=5).json()["wakes"] == 0


async def test_one_wake_takes_as_many_waiting_requests_as_a_replica_carries_at_its_target() -> None:
    calls: list[str] = []
    release = asyncio.Event()

    async def answer(request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url))
        await release.wait()
        return httpx.Response(200, stream=httpx.ByteStream(b'{"is_sleeping": false}'))

    replica_set = ReplicaSet()
    replica_set.upsert("http://a", True)
    for url in ("http://b", "http://c"):
        replica_set.upsert(url, True, parked=True)
    for replica in replica_set.replicas.values():
        replica.reachable = replica.url == "http://a"
    replica_set.replicas["http://a"].inflight = 2
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        waker = StandbyWaker(replica_set, client, RouterMetrics(), threshold=2, wait_s=5, wake_key=None)
        first, second, third = waker.reserve(), waker.reserve(), waker.reserve()
        assert first is not None and first is second and first.url == "http://b"  # two fit one wake
        assert third is not None and third.url == "http://c"  # the third wakes the next parked replica
        assert waker.reserve() is third and waker.reserve() is None  # nothing left to wake
        waits = [asyncio.create_task(waker.wait(w)) for w in (first, second, third, third)]
        release.set()
        await asyncio.gather(*waits)
    assert sorted(calls) == ["http://b/wake_up", "http://c/wake_up"]
    assert [r.url for r in replica_set.ready()] == ["http://a", "http://b", "http://c"]
    assert first.waiting == 0 and not waker.wakes
    # Below the target nothing is woken.
    replica_set.replicas["http://a"].inflight = 0
    assert not waker.pressed()


@pytest.mark.parametrize("inflight, pressed", [(0, False), (1, False), (2, True)])
def test_pressed_means_one_more_request_would_pass_the_target(inflight: int, pressed: bool) -> None:
    replica_set = ReplicaSet()
    replica_set.upsert("http://a", True)
    replica_set.replicas["http://a"].reachable = True
    replica_set.replicas["http://a"].inflight = inflight
    waker = StandbyWaker(replica_set, httpx.AsyncClient(), RouterMetrics(), threshold=2, wait_s=1, wake_key=None)
    assert waker.pressed() is pressed


def test_a_variant_replica_is_full_at_its_own_variants_target() -> None:
    replica_set = ReplicaSet()
    replica_set.upsert("http://big", True)
    replica_set.upsert("http://parked", True, parked=True)
    big = replica_set.replicas["http://big"]
    big.reachable, big.weight, big.rate = True, 4.0, 10.0  # status.variants.<name>: 4 in flight at its target
    replica_set.replicas["http://parked"].weight, replica_set.replicas["http://parked"].rate = 4.0, 10.0
    waker = StandbyWaker(replica_set, httpx.AsyncClient(), RouterMetrics(), threshold=2, wait_s=1, wake_key=None)
    big.inflight = 2
    assert not waker.pressed()  # the service's target (2) is not this variant's
    big.inflight = 4
    assert waker.pressed()
