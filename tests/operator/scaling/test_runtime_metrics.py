"""The operator's calls against the real runtime (tiny random model, CPU): its /metrics reader and its drain mark.

The names in common/metric_names.py are a contract between the runtime that
exports them and the operator that scales on them; this test holds both ends.
So are ``/ready`` and ``/drain``: a replica whose removal mark was undone (its
engine restarted, or someone sent ``DELETE /drain``) answers ``/ready`` 200
again, and the replica-planning tick's ``Drain`` puts the mark back.
"""

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from plimsoll.operator.handlers.pod_http import scrape
from plimsoll.operator.handlers.replica_client import ReplicaClient
from plimsoll.operator.handlers.replica_planning import keep_engine_mark
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.prometheus import histogram_quantile

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from plimsoll.runtime.testing import ThreadedServer, write_tiny_model

    with ThreadedServer(write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")) as running:
        yield running


async def test_runtime_metrics_parse_into_in_flight_and_latency(server: Any) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        idle = await scrape(ReplicaClient(http), f"{server.url}/metrics")
        assert isinstance(idle, PodSample), idle
        assert (idle.engine, idle.in_flight) == ("plimsoll", 0)
        served = (await http.get("/v1/models")).json()["data"][0]["id"]
        for _ in range(3):
            r = await http.post("/v1/completions", json={"model": served, "prompt": "hello", "max_tokens": 4})
            assert r.status_code == 200, r.text
        after = await scrape(ReplicaClient(http), f"{server.url}/metrics")
    assert isinstance(after, PodSample), after
    assert after.in_flight == 0  # all three finished
    assert after.kv_usage is not None and 0 <= after.kv_usage <= 1
    assert after.ttft is not None and after.tpot is not None
    assert after.requests_cut == 0  # the series is there, nothing was cut
    window = after.ttft.delta(idle.ttft)
    assert window.count == 3
    p95 = histogram_quantile(0.95, window)
    assert p95 is not None and p95 > 0


async def test_a_removal_mark_undone_by_hand_is_put_back_and_an_undrain_takes_it_off(server: Any) -> None:
    async with httpx.AsyncClient(timeout=10) as http:

        async def ready() -> int:
            return (await http.get(f"{server.url}/ready")).status_code

        assert await ready() == 200
        assert await keep_engine_mark(ReplicaClient(http), server.url, marked=True)
        assert await ready() == 503
        await http.delete(f"{server.url}/drain")  # someone takes the mark off by hand
        assert await ready() == 200
        assert await keep_engine_mark(ReplicaClient(http), server.url, marked=True)  # the next tick's Drain
        assert await ready() == 503
        assert await keep_engine_mark(
            ReplicaClient(http), server.url, marked=True
        )  # already marked: stays so
        assert await ready() == 503
        assert await keep_engine_mark(ReplicaClient(http), server.url, marked=False)
        assert await ready() == 200
    async with httpx.AsyncClient(timeout=1) as http:
        # A replica that does not answer keeps its label: the unmark is tried again next tick.
        assert not await keep_engine_mark(ReplicaClient(http), "http://127.0.0.1:9", marked=False)
