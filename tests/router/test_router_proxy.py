"""The router over real HTTP against replica processes: pass-through, errors, 429, retry, /ready, /metrics."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from router_harness import eventually, replica_metric, run_router

from plimsoll.router.proxy import REPLICA_HEADER


async def test_errors_pass_through_unchanged(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    """Must-show 4: a replica's 4xx reaches the client byte for byte; never a 5xx."""
    (replica,) = fake_replicas([{}])
    bad_requests = [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b'{"model": "fake"}'),
        ("/v1/completions", b'{"model": "nope", "prompt": "hi"}'),
        ("/v1/completions", b'{"model": "fake", "prompt": "hi", "max_tokens": -3}'),
        ("/v1/chat/completions", b'{"model": "fake", "messages": []}'),
        ("/v1/chat/completions", b'[1, 2]'),
    ]
    async with run_router(backends=(replica.url,)) as router, httpx.AsyncClient() as client:
        for path, body in bad_requests:
            headers = {"content-type": "application/json"}
            direct = await client.post(replica.url + path, content=body, headers=headers)
            routed = await client.post(router.url + path, content=body, headers=headers)
            assert 400 <= direct.status_code < 500
            assert routed.status_code == direct.status_code, (path, body, routed.text)
            assert routed.content == direct.content
            assert routed.headers["content-type"] == direct.headers["content-type"]
        # The official client sees the replica's error types, not a gateway error.
        api = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await api.completions.create(model="nope", prompt="hi")
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            await api.completions.create(model="fake", prompt="hi", max_tokens=-1)
        await api.close()
    assert router.metric("plimsoll_router_upstream_errors_total", replica=replica.url, kind="read") == 0


async def test_streams_and_json_pass_through_with_the_openai_client(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    (replica,) = fake_replicas([{}])
    async with run_router(backends=(replica.url,)) as router:
        via_router = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        direct = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0)
        for api_client in (via_router, direct):
            models = await api_client.models.list()
            assert [m.id for m in models.data] == ["fake"]
        chunks = [c async for c in await via_router.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hello"}], max_tokens=5, stream=True)]
        expected = [c async for c in await direct.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hello"}], max_tokens=5, stream=True)]
        assert [c.choices[0].delta.content for c in chunks] == [c.choices[0].delta.content for c in expected]
        assert len(chunks) == 5  # the last token carries finish_reason, as vLLM sends it
        completion = await via_router.completions.create(model="fake", prompt="hi", max_tokens=3)
        assert completion.choices[0].text == " tok tok tok"
        async with httpx.AsyncClient() as client:
            response = await client.post(router.url + "/v1/completions",
                                          json={"model": "fake", "prompt": "hi", "max_tokens": 2})
            assert response.headers[REPLICA_HEADER] == replica.url
            metrics = (await client.get(router.url + "/metrics")).text
        await via_router.close()
        await direct.close()
    assert 'plimsoll_router_routing_decisions_total{lane="all",policy="least_inflight",reason="least_inflight"}' \
        in metrics
    assert f'plimsoll_router_replica_ready{{replica="{replica.url}"}} 1.0' in metrics
    assert "plimsoll_router_request_duration_seconds_bucket" in metrics


async def test_chunks_arrive_as_the_replica_sends_them(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    """SSE is relayed chunk by chunk, not buffered: the first event arrives long before the last."""
    (replica,) = fake_replicas([{"step_t0_s": 0.1}])
    async with run_router(backends=(replica.url,)) as router, httpx.AsyncClient() as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        arrivals = []
        body = {"model": "fake", "prompt": "hi", "max_tokens": 10, "stream": True}
        async with client.stream("POST", router.url + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    arrivals.append(loop.time() - start)
    assert len(arrivals) == 11  # 10 tokens (the last with finish_reason), [DONE]
    assert arrivals[0] < 0.5 and arrivals[-1] - arrivals[0] > 0.7


async def test_429_with_retry_after_when_every_replica_is_saturated(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    replicas = fake_replicas([{"step_t0_s": 0.05}] * 2)
    async with run_router(backends=tuple(r.url for r in replicas), max_inflight_per_replica=1,
                          retry_after_seconds=3) as router, httpx.AsyncClient(timeout=30) as client:
        body = {"model": "fake", "prompt": "hi", "max_tokens": 20}
        slow = [asyncio.create_task(client.post(router.url + "/v1/completions", json=body)) for _ in range(2)]
        await eventually(
            lambda: all(router.metric("plimsoll_router_replica_inflight", replica=r.url) == 1 for r in replicas),
            "both replicas to hold one request each",
        )
        rejected = await client.post(router.url + "/v1/completions", json=body)
        assert rejected.status_code == 429
        assert rejected.headers["retry-after"] == "3"
        assert rejected.headers["x-plimsoll-overload"] == "service"  # back off: every replica is full
        assert rejected.json()["error"]["type"] == "RateLimitError"
        assert [r.status_code for r in await asyncio.gather(*slow)] == [200, 200]
        assert router.metric("plimsoll_router_rejections_total", reason="saturated") == 1


async def test_retry_on_another_replica_when_connect_fails(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    """A replica that died since the last probe: the connect fails, nothing was sent, another one answers."""
    replicas = fake_replicas([{}, {}])
    urls = tuple(r.url for r in replicas)
    async with run_router(backends=urls, policy="round-robin", scrape_interval_s=60) as router, \
            httpx.AsyncClient() as client:
        assert len(router.state.replica_set.ready()) == 2
        replicas[0].kill()
        answers = [await client.post(router.url + "/v1/completions",
                                     json={"model": "fake", "prompt": "hi", "max_tokens": 2}) for _ in range(4)]
        assert [a.status_code for a in answers] == [200] * 4
        assert {a.headers[REPLICA_HEADER] for a in answers} == {replicas[1].url}
        assert router.metric("plimsoll_router_retries_total", replica=replicas[0].url) == 1
        assert router.state.replica_set.ready()[0].url == replicas[1].url
        ready = (await client.get(router.url + "/ready")).json()
        assert ready["ready_replicas"] == 1 and replicas[1].url not in str(ready)  # counts, never pod addresses


async def test_not_ready_without_replicas_then_503(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    (replica,) = fake_replicas([{}])
    replica.kill()
    async with run_router(backends=(replica.url,)) as router, httpx.AsyncClient() as client:
        assert (await client.get(router.url + "/health")).status_code == 200
        assert (await client.get(router.url + "/ready")).status_code == 503
        response = await client.post(router.url + "/v1/completions", json={"model": "fake", "prompt": "hi"})
        assert response.status_code == 503
        assert "no ready replica" in response.json()["error"]["message"]


async def test_client_disconnect_releases_the_replica(fake_replicas) -> None:  # type: ignore[no-untyped-def]
    """A client that walks away mid-stream: the router counts it out and the replica stops generating."""
    (replica,) = fake_replicas([{"step_t0_s": 0.05}])
    async with run_router(backends=(replica.url,)) as router, httpx.AsyncClient() as client:
        body = {"model": "fake", "prompt": "hi", "max_tokens": 200, "stream": True}
        async with client.stream("POST", router.url + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break
            assert router.state.replica_set.replicas[replica.url].inflight == 1
        deadline = asyncio.get_running_loop().time() + 10
        while (router.state.replica_set.replicas[replica.url].inflight
               or replica_metric(replica, "plimsoll_num_requests_running")):
            assert asyncio.get_running_loop().time() < deadline, "the abandoned request was never released"
            await asyncio.sleep(0.05)
        assert replica_metric(replica, "plimsoll_request_success_total") == 0  # aborted, not finished
