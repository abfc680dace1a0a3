"""Hostile and generated requests get a 4xx, never a 5xx, and never stall the event loop.

What it is: a hand-written list of bodies that once crashed the engine or froze the
server, a schemathesis run over the server's own OpenAPI schema (a fixed number of
generated requests, positive and negative), and ``/health`` latency measured while
a 10 MB body, a heavy chat template and a 1 MB prompt are in flight. Afterwards the
server still answers and holds no work (running = waiting = KV usage = 0).
"""

import multiprocessing
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from server_fixtures import chat_model_dir, metric, scrape, start_server  # noqa: F401  (fixtures)

from plimsoll import metric_names as mn
from plimsoll.runtime.testing import ServerProcess, ThreadedServer

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for a in range(400) %}{% for b in range(400) %}{% for c in range(400) %}x{% endfor %}{% endfor %}{% endfor %}"

HOSTILE: list[tuple[str, Any]] = [
    (COMP, {"prompt": "hi", "max_tokens": 4, "temperature": 1e-40}),
    (COMP, {"prompt": "hi", "max_tokens": 4, "top_p": 5e-324}),
    (COMP, {"prompt": "hi", "max_tokens": 4, "repetition_penalty": 1e-300}),
    (COMP, {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [100000000], "min_tokens": 2}),
    (COMP, {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [259], "min_tokens": 2}),
    (COMP, {"prompt": [True, False], "max_tokens": 2}),
    (COMP, {"prompt": [2**40], "max_tokens": 2}),
    (COMP, {"prompt": "hi", "max_tokens": 2, "stream": True, "stop": ["x" * 100_000] * 16}),
    (COMP, {"prompt": ["p"] * 100, "n": 16, "max_tokens": 2}),
    (COMP, {"prompt": "hi", "max_tokens": 2**40}),
    (COMP, {"prompt": "hi", "max_tokens": 3, "n": 16, "seed": 2**64 - 1, "temperature": 2.0}),
    (COMP, {"prompt": "hi", "max_tokens": 3, "seed": -(2**63), "top_k": 2**40}),
    (COMP, {"prompt": "hi", "max_tokens": 3, "min_p": 1.0, "top_k": 1, "temperature": 2.0}),
    (COMP, {"prompt": "hi", "max_tokens": 3, "presence_penalty": 2.0, "frequency_penalty": -2.0}),
    (COMP, {"prompt": "hi", "max_tokens": 3, "min_tokens": 2**40}),
    (COMP, {"prompt": "hi", "max_tokens": 3, "logprobs": 21}),
    (COMP, {"prompt": "</s><s><pad>", "max_tokens": 3, "logprobs": 20, "skip_special_tokens": False}),
    (COMP, '{"prompt": "\\udcff\\ud800 lone surrogates", "max_tokens": 3}'),
    (COMP, {"prompt": "", "max_tokens": 3}),
    (COMP, {"prompt": [[]], "max_tokens": 3}),
    (COMP, {"prompt": "x" * 1_000_000, "max_tokens": 3}),
    (CHAT, {"messages": MSG, "max_tokens": 4, "temperature": 1e-40, "stream": True}),
    (
        CHAT,
        {"messages": MSG, "max_tokens": 4, "chat_template_kwargs": {"chat_template": "{{'ab '*7000000}}"}},
    ),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": "yes", "tools": [1]}}),
    (CHAT, {"messages": MSG, "max_tokens": 4, "top_logprobs": 20, "logprobs": True, "n": 16}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" * 300}]}] * 1000}),
    (CHAT, {"messages": []}),
    (CHAT, "[" * 100_000),
    (CHAT, b"\xff\xfe not json"),
]


@pytest.fixture(scope="module")
def hostile_server(chat_model_dir: Path) -> Iterator[ThreadedServer]:  # noqa: F811
    srv = start_server(chat_model_dir, max_model_len=64, max_num_seqs=16, server={"max_waiting": 64})
    yield srv
    srv.stop()


def post(url: str, path: str, body: Any, timeout: float = 120) -> httpx.Response:
    if isinstance(body, str | bytes):
        return httpx.post(
            url + path, content=body, headers={"content-type": "application/json"}, timeout=timeout
        )
    return httpx.post(url + path, json=body, timeout=timeout)


def assert_idle_and_serving(srv: ThreadedServer) -> None:
    ok = httpx.post(f"{srv.url}{COMP}", json={"prompt": "normal", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    for _ in range(200):  # an aborted request frees its blocks on the engine's next turn
        s = scrape(srv.url)
        names = (mn.NUM_REQUESTS_RUNNING, mn.NUM_REQUESTS_WAITING, mn.KV_CACHE_USAGE_RATIO)
        if all(metric(s, n) == 0 for n in names):
            break
        time.sleep(0.05)
    assert [metric(s, n) for n in names] == [0, 0, 0]
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}


def test_hostile_bodies_get_4xx_and_the_server_carries_on(hostile_server: ThreadedServer) -> None:
    codes = {}
    for path, body in HOSTILE:
        r = post(hostile_server.url, path, body)
        codes[repr(body)[:60]] = r.status_code
        assert r.status_code < 500, (body if len(repr(body)) < 200 else repr(body)[:200], r.text[:300])
        if r.status_code >= 400:
            assert len(r.json()["error"]["message"]) > 10
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-300:]
    assert_idle_and_serving(hostile_server)


FUZZ_PER_MODE = 130  # x 2 endpoints x 2 modes = 520 generated requests


def test_schemathesis_fuzz_of_the_openapi_schema_gets_no_5xx(hostile_server: ThreadedServer) -> None:
    schema = schemathesis.openapi.from_dict(hostile_server.app.openapi())
    statuses: Counter[int] = Counter()
    failures: list[str] = []

    def fuzz(path: str, mode: GenerationMode) -> None:
        strategy = schema[path]["POST"].as_strategy(generation_mode=mode)

        @settings(
            max_examples=FUZZ_PER_MODE,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy, stream=st.booleans())
        def send(case: Any, stream: bool) -> None:
            body = case.body
            if isinstance(body, dict):
                # Bound the work per request: the fuzz looks for crashes, not long completions.
                m = body.get("max_tokens")
                if isinstance(m, int) and not isinstance(m, bool) and m > 4:
                    body = {**body, "max_tokens": 4}
                if stream and "stream" not in body:
                    body = {**body, "stream": True}
            r = post(hostile_server.url, path, body, timeout=60)
            statuses[r.status_code] += 1
            if r.status_code >= 500 or '"code":500' in r.text:
                failures.append(f"{path} {body!r:.300} -> {r.status_code} {r.text[:300]}")

        send()

    for path in (COMP, CHAT):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(path, mode)
    total = sum(statuses.values())
    print(f"schemathesis fuzz: {total} requests, status codes {dict(sorted(statuses.items()))}")
    assert total >= 500, statuses
    assert not failures, failures[:5]
    assert_idle_and_serving(hostile_server)


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _probe(client: httpx.Client, url: str) -> float:
    t0 = time.perf_counter()
    assert client.get(f"{url}/health").status_code == 200
    return time.perf_counter() - t0


def test_health_answers_fast_while_hostile_requests_are_in_flight(chat_model_dir: Path) -> None:  # noqa: F811
    # Its own process, as in production: the probes and the hammering threads of this test
    # must not share the server's interpreter lock.
    args = ["--model", str(chat_model_dir), "--max-model-len", "64", "--kv-cache-memory", "4MiB"]
    srv = ServerProcess([*args, "--allow-client-chat-template", "--log-level", "warning"])
    srv.start()  # ServerProcess.stop() leaves its log file open; __exit__ closes it
    try:
        stop = threading.Event()
        heavy = [
            (COMP, b'{"prompt": "' + b"x" * 10_000_000 + b'"}'),
            (CHAT, {"messages": MSG, "chat_template_kwargs": {"chat_template": "{{'ab '*7000000}}"}}),
            (CHAT, {"messages": MSG, "chat_template_kwargs": {"chat_template": NESTED_LOOPS}}),
            (COMP, {"prompt": "x" * 1_000_000, "max_tokens": 2}),
        ]
        sent: Counter[int] = Counter()

        def hammer(path: str, body: Any) -> None:
            while not stop.is_set():
                sent[post(srv.url, path, body).status_code] += 1

        # The same probes first with the host made as busy by plain CPU burners (one per
        # hammering thread): what the probes pay for a contended host, so that the bound
        # below measures stalls of the server's event loop, not how fast this machine is.
        burners = [multiprocessing.get_context("spawn").Process(target=_burn, args=(60.0,)) for _ in heavy]
        for b in burners:
            b.start()
        try:
            with httpx.Client(timeout=10) as client:
                baseline = sorted(_probe(client, srv.url) for _ in range(300))
        finally:
            for b in burners:
                b.terminate()
                b.join()

        threads = [threading.Thread(target=hammer, args=h) for h in heavy]
        for t in threads:
            t.start()
        latencies = []
        with httpx.Client(timeout=10) as client:
            while sum(sent.values()) < 8 or len(latencies) < 300:
                latencies.append(_probe(client, srv.url))
        stop.set()
        for t in threads:
            t.join()
        latencies.sort()
        p50 = statistics.median(latencies)
        p99 = latencies[int(len(latencies) * 0.99) - 1]
        base_p99 = baseline[int(len(baseline) * 0.99) - 1]
        print(
            f"/health under hostile load: {len(latencies)} probes, p50 {p50 * 1e3:.1f} ms, "
            f"p99 {p99 * 1e3:.1f} ms, max {latencies[-1] * 1e3:.1f} ms; with CPU burners only: "
            f"p50 {statistics.median(baseline) * 1e3:.1f} ms, p99 {base_p99 * 1e3:.1f} ms; "
            f"hostile responses {dict(sent)}"
        )
        assert set(sent) <= {400, 413, 429}, sent  # 429: every template worker busy (Retry-After)
        # The target is p99 < 100 ms; on a host where plain contention already costs the probes
        # more, the bound is 3x what that contention costs (a stalled loop costs seconds).
        assert p99 < max(0.1, 3 * base_p99), (p50, p99, latencies[-1], base_p99)
    finally:
        srv.__exit__(None, None, None)
