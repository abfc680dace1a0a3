"""The operator's scale-down mark: POST /drain drops readiness but still serves; the cut counter exists."""

import httpx
from server_fixtures import chat_model_dir, metric, scrape, server  # noqa: F401  (fixtures)

from plimsoll import metric_names as mn
from plimsoll.runtime.testing import ThreadedServer


def test_a_replica_marked_for_removal_is_unready_but_still_answers(server: ThreadedServer) -> None:  # noqa: F811
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
    marked = httpx.post(f"{server.url}/drain", timeout=10)
    assert marked.status_code == 200 and marked.json()["markedForRemoval"] is True
    ready = httpx.get(f"{server.url}/ready", timeout=10)
    assert ready.status_code == 503 and ready.json()["reason"] == "marked for removal"
    # A request already on its way when the mark lands is served, not refused.
    answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert httpx.delete(f"{server.url}/drain", timeout=10).json()["markedForRemoval"] is False
    assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
    # The counter the operator reads after a scale-down is exported from the start, at 0.
    assert metric(scrape(server.url), mn.REQUESTS_CUT_BY_SHUTDOWN) == 0


async def test_requests_left_at_the_drain_deadline_are_counted_as_cut() -> None:
    import types

    import uvicorn

    from plimsoll.runtime.serving.lifecycle import DrainingServer
    from plimsoll.runtime.serving.metrics import ServerMetrics

    metrics = ServerMetrics("m")

    async def never_idle(timeout: float) -> bool:
        return False

    ctx = types.SimpleNamespace(num_in_flight=3, settings=types.SimpleNamespace(drain_timeout=0.0),
                                metrics=metrics, wait_idle=never_idle)  # fmt: skip
    draining = DrainingServer(uvicorn.Config(app=None), ctx)  # type: ignore[arg-type]
    await draining._drain()
    assert draining.should_exit
    value = metrics.registry.get_sample_value(mn.REQUESTS_CUT_BY_SHUTDOWN, {"model_name": "m"})
    assert value == 3
