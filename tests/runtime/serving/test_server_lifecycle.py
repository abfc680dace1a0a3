"""Lifecycle a Kubernetes replica needs: disconnects free KV at once, overload is 429 not 5xx,
timeouts abort, SIGTERM drains in-flight streams and exits 0."""

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import chat_model_dir, metric, scrape, server, start_server  # noqa: F401  (fixtures)

from plimsoll import metric_names as mn
from plimsoll.runtime.testing import ServerProcess, ThreadedServer


def wait_idle(url: str, timeout: float = 15.0) -> dict[str, float]:
    """Scrape until running, waiting and KV usage are all 0 (or the timeout passes)."""
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(url)
        idle = all(
            metric(s, n) == 0
            for n in (mn.NUM_REQUESTS_RUNNING, mn.NUM_REQUESTS_WAITING, mn.KV_CACHE_USAGE_RATIO)
        )
        if idle or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


@pytest.mark.slow
async def test_half_of_200_streams_disconnect_and_every_block_is_freed(server: ThreadedServer) -> None:  # noqa: F811
    before = scrape(server.url)
    rng = random.Random(0)
    # (hang up?, after how many chunks); a chunk may carry several tokens, so a stream can end first.
    plan = [(rng.random() < 0.5, rng.randint(1, 8)) for _ in range(200)]
    completed = disconnected = 0
    limits = httpx.Limits(max_connections=48)

    async def one(i: int, hang_up: bool, after: int, client: httpx.AsyncClient) -> None:
        nonlocal completed, disconnected
        body = {"prompt": f"request {i}", "max_tokens": 24, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if not line:
                    continue
                n += 1
                if hang_up and n >= after:
                    disconnected += 1
                    return  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    completed += 1

    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(one(i, h, a, client) for i, (h, a) in enumerate(plan)))
    assert completed + disconnected == 200 and disconnected >= 0.4 * 200

    after = wait_idle(server.url)
    assert metric(after, mn.KV_CACHE_USAGE_RATIO) == 0.0
    assert metric(after, mn.NUM_REQUESTS_RUNNING) == 0 and metric(after, mn.NUM_REQUESTS_WAITING) == 0
    stats = server.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks  # every block back in the pool
    assert server.ctx.num_in_flight == 0
    # Every request is accounted for once: finished by length, or aborted by its disconnect.
    success = mn.REQUEST_SUCCESS.removesuffix("_total") + "_total"

    def delta(reason: str) -> float:
        return metric(after, success, finished_reason=reason) - metric(
            before, success, finished_reason=reason
        )

    assert delta("length") + delta("abort") == 200
    # A client that hangs up after the server already sent its last token aborts nothing.
    assert disconnected / 2 < delta("abort") <= disconnected


async def test_ready_is_503_and_requests_wait_while_the_engine_loads(chat_model_dir: Path) -> None:  # noqa: F811
    from plimsoll.runtime.engine.async_engine import AsyncEngine
    from plimsoll.runtime.engine.config import EngineConfig
    from plimsoll.runtime.serving.server import build_app
    from plimsoll.runtime.serving.settings import ServerSettings

    engine = AsyncEngine(
        EngineConfig(model=str(chat_model_dir))
    )  # not started: ASGITransport runs no lifespan
    app = build_app(engine, ServerSettings(served_model_name="tiny"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        assert (await client.get("/health")).status_code == 200
        ready = await client.get("/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "loading"
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "still loading" in r.json()["error"]["message"]
        assert "retry-after" in r.headers


def test_non_streaming_client_that_gives_up_aborts_its_request(chat_model_dir: Path) -> None:  # noqa: F811
    # Every step sleeps 50 ms, so 220 tokens take >= 11 s on any machine: the client's
    # 0.3 s read timeout always fires while the request is still running.
    with start_server(chat_model_dir, step_delay=0.05) as slow:
        _gives_up_and_is_aborted(slow)


def _gives_up_and_is_aborted(srv: ThreadedServer) -> None:
    before = scrape(srv.url)
    body = {"prompt": "a long one", "max_tokens": 220, "ignore_eos": True}
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    after = wait_idle(srv.url)
    assert metric(after, mn.KV_CACHE_USAGE_RATIO) == 0.0 and srv.ctx.num_in_flight == 0
    aborted = metric(after, mn.REQUEST_SUCCESS, finished_reason="abort") - metric(
        before, mn.REQUEST_SUCCESS, finished_reason="abort"
    )
    generated = metric(after, mn.GENERATION_TOKENS) - metric(before, mn.GENERATION_TOKENS)
    assert aborted == 1 and generated < 220, (aborted, generated, time.monotonic() - started)


@pytest.mark.slow
async def test_overload_gets_only_200_or_429_and_the_server_recovers(chat_model_dir: Path) -> None:  # noqa: F811
    srv = start_server(chat_model_dir, max_num_seqs=4, server={"max_waiting": 4})
    try:
        async with httpx.AsyncClient(
            base_url=srv.url, timeout=120, limits=httpx.Limits(max_connections=100)
        ) as client:

            async def one(i: int) -> httpx.Response:
                body = {"prompt": f"load {i}", "max_tokens": 12, "ignore_eos": True, "stream": i % 2 == 0}
                return await client.post("/v1/completions", json=body)

            responses = await asyncio.gather(*(one(i) for i in range(80)))
            codes = [r.status_code for r in responses]
            assert set(codes) <= {200, 429}, codes
            assert codes.count(429) >= 20 and codes.count(200) >= 8, codes
            for r in responses:
                if r.status_code == 429:
                    assert int(r.headers["retry-after"]) >= 1
                    assert r.headers["x-plimsoll-overload"] == "replica"  # a router tries another replica
                    assert r.json()["error"]["type"] == "RateLimitError"
                    assert "--max-waiting" in r.json()["error"]["message"]
                elif r.headers["content-type"].startswith("text/event-stream"):
                    assert sse_events(r.text)[-1] == "[DONE]"
            s = wait_idle(srv.url)
            rejected = metric(
                s, mn.ADMISSION_REJECTIONS.removesuffix("_total") + "_total", reason="queue_full"
            )
            assert rejected == codes.count(429)
            # Recovered: the queue drained and a new request goes straight through.
            ok = await client.post("/v1/completions", json={"prompt": "after", "max_tokens": 3})
            assert ok.status_code == 200
            assert metric(s, mn.KV_CACHE_USAGE_RATIO) == 0.0
    finally:
        srv.stop()


@pytest.mark.slow
def test_request_timeout_aborts_and_reports(chat_model_dir: Path) -> None:  # noqa: F811
    # 50 ms per step: 200 tokens take >= 10 s, past the 0.3 s timeout however fast the CPU is.
    srv = start_server(chat_model_dir, server={"request_timeout": 0.3}, step_delay=0.05)
    try:
        long = {"prompt": "long", "max_tokens": 200, "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json=long, timeout=60)
        assert r.status_code == 504, r.text
        assert "--request-timeout" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/completions", json={**long, "stream": True}, timeout=60)
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and "request-timeout" in json.loads(events[-2])["error"]["message"]
        s = wait_idle(srv.url)
        assert metric(s, mn.KV_CACHE_USAGE_RATIO) == 0.0
        assert metric(s, mn.REQUEST_SUCCESS.removesuffix("_total") + "_total", finished_reason="abort") == 2
        assert metric(s, mn.ADMISSION_REJECTIONS.removesuffix("_total") + "_total", reason="timeout") == 2
        short = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "short", "max_tokens": 2}, timeout=60)
        assert short.status_code == 200
    finally:
        srv.stop()


def _stream_in_thread(url: str, i: int, results: dict[int, Any], started: "list[int]") -> None:
    body = {
        "messages": [{"role": "user", "content": f"drain {i}"}],
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            events: list[str] = []
            for line in r.iter_lines():
                if line:
                    events.append(line.removeprefix("data: "))
                    if len(events) == 2:
                        started.append(i)
            results[i] = (r.status_code, events)
    except Exception as exc:  # recorded, asserted by the test
        results[i] = exc


@pytest.mark.slow
def test_sigterm_during_16_streams_finishes_them_refuses_new_work_and_exits_0(chat_model_dir: Path) -> None:  # noqa: F811
    import threading

    args = [
        "--model",
        str(chat_model_dir),
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "4MiB",
        "--drain-timeout",
        "60",
    ]
    with ServerProcess(args, startup_timeout=240) as proc:
        results: dict[int, Any] = {}
        started: list[int] = []
        threads = [
            threading.Thread(target=_stream_in_thread, args=(proc.url, i, results, started))
            for i in range(16)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(started) < 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(started) == 16, f"only {len(started)} streams started"
        proc.terminate()
        # Each stream still has ~190 tokens to go, seconds of work: the drain window is open.
        deadline = time.monotonic() + 5
        while (
            ready := httpx.get(f"{proc.url}/ready", timeout=10)
        ).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.status_code == 503 and ready.json()["reason"] == "draining"
        refused = httpx.post(
            f"{proc.url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10
        )
        assert refused.status_code == 503
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        assert httpx.get(f"{proc.url}/health", timeout=10).status_code == 200  # alive while draining
        for t in threads:
            t.join(120)
        code = proc.wait(60)
        for i in range(16):
            assert not isinstance(results[i], Exception), results[i]
            status, events = results[i]
            assert status == 200 and events[-1] == "[DONE]"
            finish = [
                c["finish_reason"]
                for e in events[:-1]
                for c in json.loads(e)["choices"]
                if c["finish_reason"]
            ]
            assert finish == ["length"], (i, finish)
        assert code == 0, proc.log()
        assert len(started) == 16 and "drained; shutting down" in proc.log()
        assert proc.log().count('"event":"request_finished"') == 16
        assert "drain 3" not in proc.log()  # prompt text is never logged
