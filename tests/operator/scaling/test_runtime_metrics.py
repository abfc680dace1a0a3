"""The autoscaler's reader against the real runtime's /metrics (tiny random model, CPU).

The names in common/metric_names.py are a contract between the runtime that
exports them and the operator that scales on them; this test holds both ends.
"""

from pathlib import Path

import httpx
import pytest

from plimsoll.operator.handlers.autoscaling import scrape
from plimsoll.operator.handlers.replica_client import ReplicaClient
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.prometheus import histogram_quantile

pytestmark = pytest.mark.slow


async def test_runtime_metrics_parse_into_in_flight_and_latency(tmp_path: Path) -> None:
    from plimsoll.runtime.testing import ThreadedServer, write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    with ThreadedServer(model) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            idle = await scrape(ReplicaClient(http), f"{server.url}/metrics")
            assert isinstance(idle, PodSample), idle
            assert (idle.engine, idle.in_flight) == ("plimsoll", 0)
            served = (await http.get("/v1/models")).json()["data"][0]["id"]
            for _ in range(3):
                r = await http.post(
                    "/v1/completions", json={"model": served, "prompt": "hello", "max_tokens": 4}
                )
                assert r.status_code == 200, r.text
            after = await scrape(ReplicaClient(http), f"{server.url}/metrics")
    assert isinstance(after, PodSample), after
    assert after.in_flight == 0  # all three finished
    assert after.kv_usage is not None and 0 <= after.kv_usage <= 1
    assert after.ttft is not None and after.tpot is not None
    window = after.ttft.delta(idle.ttft)
    assert window.count == 3
    p95 = histogram_quantile(0.95, window)
    assert p95 is not None and p95 > 0
