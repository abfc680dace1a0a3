"""One request cannot take the replica down: a fault in one request's sampling fails that
request only; an engine that cannot continue says so and the server drains and stops;
admission counts sequences; streams equal non-streamed responses token for token; the
drain deadline ends cut streams with an error event and [DONE].

Faults are injected into the real engine of an in-process server (its sampler or model
runner is wrapped); slow steps come from ``ThreadedServer(step_delay=...)``, so nothing
here races the wall clock.
"""

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import chat_model_dir, metric, scrape, start_server  # noqa: F401  (fixtures)

from plimsoll import metric_names as mn

POISON_SEED = 666


class PoisonedSampler:
    """The engine's sampler, except that sampling a request seeded POISON_SEED raises."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, reqs: list[Any], logits: Any) -> Any:
        if any(r.params.seed == POISON_SEED for r in reqs):
            raise FloatingPointError("injected: probabilities are NaN")
        return self.inner(reqs, logits)


def sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


def stream(url: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    r = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=120)
    return r.status_code, sse_events(r.text)


def test_a_fault_in_one_requests_sampling_fails_only_that_request(
    chat_model_dir: Path, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    caplog.set_level("ERROR", logger="plimsoll.runtime.requests")
    with start_server(chat_model_dir) as srv:
        core = srv.engine.engine
        core.sampler = PoisonedSampler(core.sampler)
        common = {"max_tokens": 24, "ignore_eos": True, "temperature": 1.0}
        usage = {"include_usage": True}
        results: dict[int, Any] = {}

        def one(i: int) -> None:
            seed = POISON_SEED if i == 0 else i
            results[i] = stream(srv.url, {"prompt": f"p{i}", "seed": seed, "stream_options": usage, **common})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        status, events = results[0]
        assert status == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 500 and "failed in the engine" in error["message"]
        # The client gets the request id; the exception text (paths, shapes, others' data) stays in the log.
        assert "cmpl-" in error["message"] and "injected" not in error["message"]
        request_id = next(w for w in error["message"].split() if w.startswith("cmpl-"))
        assert any(request_id in r.getMessage() and "injected" in r.getMessage() for r in caplog.records)
        for i in range(1, 6):
            status, events = results[i]
            assert status == 200 and events[-1] == "[DONE]", events[-3:]
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 24
        s = scrape(srv.url)
        assert metric(s, mn.REQUEST_ERRORS, reason="engine_error") == 1
        assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
        ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "after", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200


def test_an_engine_fatal_fault_reports_engine_failed_and_stops_the_server(chat_model_dir: Path) -> None:  # noqa: F811
    srv = start_server(chat_model_dir, server={"drain_timeout": 5})
    try:
        runner = srv.engine.engine.runner

        def broken_execute(*_: Any, **__: Any) -> Any:
            raise RuntimeError("injected: CUDA error: an illegal memory access was encountered")

        runner.execute = broken_execute
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=60)
        assert r.status_code in (500, 503), r.text
        assert "engine" in r.json()["error"]["message"]
        # The server drains and stops on its own; the CLI turns srv.fatal into exit code 1.
        srv._thread.join(timeout=60)  # type: ignore[union-attr]
        assert not srv._thread.is_alive()  # type: ignore[union-attr]
        assert srv.fatal and "illegal memory access" in str(srv.fatal[0])
    finally:
        srv.stop()


def test_an_engine_fatal_fault_makes_health_and_ready_say_engine_failed(chat_model_dir: Path) -> None:  # noqa: F811
    # An admitted request that has not finished (a client still reading its response) keeps
    # the drain waiting, so the probes can be read after the engine died.
    srv = start_server(chat_model_dir, server={"drain_timeout": 60}, step_delay=0.05)
    try:
        started = threading.Event()
        pending = srv.ctx.admit("held")

        def hold() -> None:  # an in-flight stream keeps the drain waiting
            with httpx.stream(
                "POST",
                f"{srv.url}/v1/completions",
                json={"prompt": "hold", "max_tokens": 2, "stream": True},
                timeout=60,
            ) as r:
                for _ in r.iter_lines():
                    started.set()

        runner = srv.engine.engine.runner
        real = runner.execute
        calls = {"n": 0}

        def dies_later(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] > 1:
                raise RuntimeError("injected: out of device memory")
            return real(*args, **kwargs)

        runner.execute = dies_later
        t = threading.Thread(target=hold)
        t.start()
        t.join(timeout=60)
        health = httpx.get(f"{srv.url}/health", timeout=10)
        ready = httpx.get(f"{srv.url}/ready", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "engine failed"}
        assert ready.status_code == 503 and ready.json()["reason"] == "engine failed"
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "loading" not in r.text
        srv.server._loop.call_soon_threadsafe(pending.release)  # type: ignore[union-attr]
        srv._thread.join(timeout=60)  # type: ignore[union-attr]
        assert not srv._thread.is_alive() and srv.fatal  # type: ignore[union-attr]
    finally:
        srv.stop()


def test_admission_counts_prompts_times_n(chat_model_dir: Path) -> None:  # noqa: F811
    # Room for 4 running + 4 waiting sequences; steps are slow so admitted work stays in flight.
    srv = start_server(chat_model_dir, max_num_seqs=4, server={"max_waiting": 4}, step_delay=0.05)
    try:
        held: list[Any] = []
        client = httpx.Client(base_url=srv.url, timeout=120)

        def open_stream(body: dict[str, Any]) -> int:
            own = httpx.Client(base_url=srv.url, timeout=120)  # a connection of its own, held open
            req = own.build_request("POST", "/v1/completions", json={**body, "stream": True})
            r = own.send(req, stream=True)
            held.append(r)  # headers came back: admitted (a waiting request sends no chunk yet)
            return r.status_code

        long = {"max_tokens": 200, "ignore_eos": True}
        assert open_stream({"prompt": ["a", "b"], "n": 2, **long}) == 200  # 4 sequences
        assert open_stream({"prompt": "c", "n": 4, **long}) == 200  # 8: full
        assert srv.ctx.num_seqs_in_flight == 8, srv.ctx.num_seqs_in_flight
        refused = client.post("/v1/completions", json={"prompt": "d", "max_tokens": 2})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert "8 sequences in flight" in refused.json()["error"]["message"]
        too_big = client.post("/v1/completions", json={"prompt": ["x", "y", "z"], "n": 4, "max_tokens": 2})
        assert too_big.status_code == 400 and "12 sequences" in too_big.json()["error"]["message"]
        for r in held:
            r.close()
        # Closing the streams aborted them; the room is back.
        for _ in range(600):
            if srv.ctx.num_seqs_in_flight == 0:
                break
            threading.Event().wait(0.05)
        ok = client.post("/v1/completions", json={"prompt": ["d", "e"], "n": 4, "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 8
        s = scrape(srv.url)
        assert metric(s, mn.ADMISSION_REJECTIONS, reason="queue_full") == 1
        client.close()
    finally:
        srv.stop()


def test_streamed_tokens_and_logprobs_equal_the_non_streamed_response(chat_model_dir: Path) -> None:  # noqa: F811
    # Byte-level tokens >= 0x80 are partial UTF-8: their text delta is empty until the
    # character completes, and special tokens have no text at all with skip_special_tokens.
    with start_server(chat_model_dir) as srv:
        empty_deltas = 0
        for seed in range(8):
            body = {"prompt": "special", "max_tokens": 48, "ignore_eos": True, "seed": seed, "logprobs": 1}
            whole = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()
            status, events = stream(srv.url, {**body, "stream_options": {"include_usage": True}})
            assert status == 200 and events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            tokens: list[str] = []
            logprobs: list[float] = []
            text = ""
            for c in chunks:
                for choice in c["choices"]:
                    text += choice["text"]
                    empty_deltas += choice["text"] == "" and choice["finish_reason"] is None
                    if choice["logprobs"]:
                        tokens += choice["logprobs"]["tokens"]
                        logprobs += choice["logprobs"]["token_logprobs"]
            expected = whole["choices"][0]["logprobs"]
            assert tokens == expected["tokens"] and len(tokens) == 48
            assert logprobs == pytest.approx(expected["token_logprobs"])
            assert text == whole["choices"][0]["text"]
            assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 48
        assert empty_deltas > 0  # the case under test did occur


def test_drain_finishes_streams_and_cuts_the_rest_at_the_deadline(chat_model_dir: Path) -> None:  # noqa: F811
    # 50 ms steps: 3 tokens finish well inside a 3 s drain; 240 tokens (>= 12 s) never can.
    srv = start_server(chat_model_dir, server={"drain_timeout": 3}, step_delay=0.05)
    try:
        results: dict[int, Any] = {}
        started = threading.Semaphore(0)

        def one(i: int, max_tokens: int) -> None:
            body = {
                "prompt": f"d{i}",
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
                events = []
                for line in r.iter_lines():
                    if line:
                        if not events:
                            started.release()
                        events.append(line.removeprefix("data: "))
            results[i] = events

        threads = [threading.Thread(target=one, args=(i, 240 if i >= 2 else 3)) for i in range(4)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60)
        srv.drain()
        for t in threads:
            t.join(timeout=60)
        for i in range(4):
            events = results[i]
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            if i < 2:
                assert last["usage"]["completion_tokens"] == 3
            else:
                assert last["error"]["code"] == 503 and "drain deadline" in last["error"]["message"]
        srv._thread.join(timeout=30)  # type: ignore[union-attr]
        assert not srv._thread.is_alive()  # type: ignore[union-attr]
    finally:
        srv.stop()
