"""The operator asks every router pod's ``GET /hold``: held requests add up, refusals stay per router.

Two real routers (uvicorn on real sockets, in this test's event loop) with no Ready replica behind
them and holding off: each answers what it is sent itself (``no_replica``, a malformed bound
``invalid_request``). With ``router.replicas`` 2 each router sees only its share of the clients,
so reading one would miss the other's refusals.
"""

import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "router"))  # the router tests' harness

from router_harness import run_router

from plimsoll.operator.handlers import pod_http
from plimsoll.operator.handlers.replica_client import ReplicaClient
from plimsoll.operator.scaling.shed_demand import attainment_misses, demand_refusals
from plimsoll.ttft_prediction import SLO_TTFT_HEADER

BODY = {"model": "m", "prompt": "hi", "max_tokens": 1}


async def test_every_router_is_asked_and_their_refusals_are_kept_apart() -> None:
    nobody = ("http://127.0.0.1:9",)  # a replica that never answers: never Ready
    async with (
        run_router(backends=nobody) as a,
        run_router(backends=nobody) as b,
        httpx.AsyncClient(trust_env=False) as http,
    ):
        for url, sent in ((a.url, 2), (b.url, 1)):
            for _ in range(sent):
                assert (await http.post(f"{url}/v1/completions", json=BODY)).status_code == 503
        bad = await http.post(f"{b.url}/v1/completions", json=BODY, headers={SLO_TTFT_HEADER: "soon"})
        assert bad.status_code == 400
        gone = "http://127.0.0.1:9/hold"  # a router pod that does not answer is left out, not fatal
        demand = await pod_http.hold(ReplicaClient(http), [f"{a.url}/hold", gone, f"{b.url}/hold"])
    assert demand is not None and demand.held == 0
    assert dict(demand.refused) == {
        f"{a.url}/hold": {"no_replica": 2.0},
        f"{b.url}/hold": {"no_replica": 1.0, "invalid_request": 1.0},
    }
    # Neither is for want of room: no demand, no SLO miss.
    assert demand_refusals(demand, {}) == {} and attainment_misses(demand, {}) == {}


async def test_the_parked_pods_a_router_woke_reach_the_planner() -> None:
    parked = "http://127.0.0.1:9"
    async with run_router(backends=(parked,), scrape_interval_s=600) as a, httpx.AsyncClient(trust_env=False) as http:
        replica = a.state.replica_set.replicas[parked]
        # What its waker leaves on a parked replica it woke (router/standby_wake.py), discovered as pod p2.
        replica.parked, replica.pod, replica.reachable, replica.woken_at = True, "p2", True, time.monotonic()
        demand = await pod_http.hold(ReplicaClient(http), [f"{a.url}/hold"])
    assert demand is not None and set(demand.woken) == {"p2"} and 0 <= demand.woken["p2"] < 60
