"""Predicted-TTFT routing: a request goes only where it can meet its x-slo-ttft-ms; when none can, 429 at once.

Two simulated replicas, one sequence each, 50 ms steps: a 1000-token streamed answer
holds a replica for 50 s, so a replica serving one predicts a TTFT far beyond 500 ms.
The long answers are closed once the checks are done. The test waits on what the
router scraped (markers), never on a guess at timing.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from router_harness import RunningRouter, eventually, fake_replicas, run_router  # noqa: F401

from plimsoll.overload import OVERLOAD_HEADER
from plimsoll.router.backends import Replica, ReplicaSet, TokenLoad
from plimsoll.router.discovery import is_draining, is_parked
from plimsoll.router.slo_routing import predicted_ttft, slo_exclusions
from plimsoll.ttft_prediction import SLO_TTFT_HEADER

CURVE = {"batch_cap": 1, "step_t0_s": 0.05, "prefill_s_per_token": 0.002}
LONG = {"model": "fake", "prompt": "a b c", "max_tokens": 1000, "stream": True}
SHORT = {"model": "fake", "prompt": "a b c", "max_tokens": 2}
BOUND = {SLO_TTFT_HEADER: "500"}


def test_the_prediction_adds_what_the_router_sent_since_the_scrape() -> None:
    r = Replica(
        "http://r", token_load=TokenLoad(backlog_s=0.5, prefill_tokens_per_s=100.0, decode_step_s=0.05)
    )
    assert predicted_ttft(r, 10) == 0.5 + 0.1 + 0.05
    r.inflight = 2  # two more sent since the scrape: their prompts come first
    assert predicted_ttft(r, 10) == 0.5 + 0.2 + 0.1 + 0.05
    unknown = Replica("http://v")  # vLLM: no backlog exported, never excluded
    missing, refusal = slo_exclusions([r, unknown], 10, 0.3)
    assert missing == {"http://r"} and refusal is None
    missing, refusal = slo_exclusions([r], 10, 0.3)
    assert missing == {"http://r"} and refusal is not None
    assert refusal.retry_after_s == 1 and "TTFT bound of 300 ms" in refusal.message()
    assert slo_exclusions([r], 10, None) == (set(), None)  # no bound: nothing is judged


def test_parked_standby_pods_are_routed_nothing() -> None:
    def pod(labels: dict[str, str]) -> dict[str, object]:
        return {"metadata": {"labels": labels}}

    assert is_parked(pod({"plimsoll.dev/standby": "true"})) and is_draining(pod({"plimsoll.dev/draining": "true"}))
    assert not is_parked(pod({"plimsoll.dev/standby": "false"})) and not is_draining({"metadata": {}})
    # Parked and Ready (a pod whose kubelet has not yet seen it asleep): still routed nothing.
    replica_set = ReplicaSet()
    replica_set.upsert("http://parked", True, parked=True)
    replica_set.upsert("http://awake", True)
    for replica in replica_set.replicas.values():
        replica.reachable = True
    assert [r.url for r in replica_set.ready()] == ["http://awake"]
    assert not replica_set.get("http://parked").is_away  # type: ignore[union-attr]


@contextlib.asynccontextmanager
async def long_answer(http: httpx.AsyncClient) -> AsyncIterator[str]:
    """A 50 s streamed answer under way; yields the replica it runs on, closes it on exit."""
    response = await http.send(http.build_request("POST", "/v1/completions", json=LONG), stream=True)
    try:
        assert response.status_code == 200
        yield response.headers["x-plimsoll-replica"]
    finally:
        await response.aclose()


def busy(router: RunningRouter, url: str) -> bool:
    """The router has scraped ``url`` since its long answer started (a backlog past the bound)."""
    replica = router.state.replica_set.replicas.get(url)
    return replica is not None and replica.token_load is not None and replica.token_load.backlog_s > 0.5


async def test_requests_avoid_a_replica_that_would_miss_and_are_refused_when_all_would(fake_replicas) -> None:  # noqa: F811
    a, b = fake_replicas([CURVE, CURVE])
    async with (
        run_router(backends=(a.url, b.url), scrape_interval_s=0.1) as router,
        httpx.AsyncClient(base_url=router.url, timeout=60) as http,
    ):
        async with long_answer(http) as first:
            await eventually(lambda: busy(router, first), "the router to scrape the busy replica")
            served = await http.post("/v1/completions", json=SHORT, headers=BOUND)
            assert served.status_code == 200, served.text
            # The bounded request went to the replica the long answer was not on.
            other = served.headers["x-plimsoll-replica"]
            assert other != first
            # A replica's load is what it last reported running and waiting: wait until a scrape
            # shows the short request gone, or the two tie and the next answer may land on `first`.
            await eventually(lambda: router.state.replica_set.replicas[other].load == 0, "the other replica idle")
            async with long_answer(http) as second:
                assert second != first
                await eventually(lambda: busy(router, second), "the router to scrape the second busy replica")
                refused = await http.post("/v1/completions", json=SHORT, headers=BOUND)
                assert refused.status_code == 429, refused.text  # refused, not queued behind 50 s answers
                assert (
                    refused.headers[OVERLOAD_HEADER] == "service" and int(refused.headers["retry-after"]) >= 1
                )
                assert "would miss this request's TTFT bound of 500 ms" in refused.json()["error"]["message"]
                bad = await http.post("/v1/completions", json=SHORT, headers={SLO_TTFT_HEADER: "soon"})
                assert bad.status_code == 400 and SLO_TTFT_HEADER in bad.json()["error"]["message"]
        hold = (await http.get("/hold")).json()
        assert hold["shedSloTotal"] == 1
        # Every refusal by reason, for the operator (demand and SLO misses): the malformed bound is the client's.
        assert hold["refusedTotal"] == {"slo_ttft": 1, "invalid_request": 1}
        assert router.metric("plimsoll_router_rejections_total", reason="slo_ttft") == 1
