"""One request through a real router and a real replica yields one trace, as an OTLP receiver sees it.

The receiver is a plain HTTP server on 127.0.0.1 that decodes each POST /v1/traces
body with ``opentelemetry-proto`` (the collector's own wire format). Both processes
export to it; the test waits for the spans to arrive (observable marker, no sleeps
standing in for it) and checks names, parentage and GenAI attributes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from otlp_receiver import Receiver

from plimsoll.runtime.testing import ServerProcess, free_port, write_tiny_model

pytestmark = pytest.mark.slow

FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # ms between batch exports


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def test_one_request_through_router_and_replica_is_one_trace(receiver: Receiver) -> None:
    model = write_tiny_model(tempfile.gettempdir() + "/plimsoll-trace-tiny-model")
    replica = ServerProcess(
        ["--model", str(model), "--served-model-name", "tiny", "--kv-cache-memory", "512KiB",
         "--max-num-batched-tokens", "8", "--otlp-traces-endpoint", receiver.url, "--drain-timeout", "1"],
        env={**os.environ, **FAST_EXPORT}, startup_timeout=300,
    )
    with replica:
        port = free_port("127.0.0.1")
        router = subprocess.Popen(
            [sys.executable, "-c", "from plimsoll.cli import main; main()", "route", "--host", "127.0.0.1",
             "--port", str(port), "--backend", replica.url, "--otlp-traces-endpoint", receiver.url],
            env={**replica.env, **FAST_EXPORT}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and router.poll() is None, "router never became ready"
                time.sleep(0.1)
            parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            resp = httpx.post(
                f"{url}/v1/completions",
                json={"model": "tiny", "prompt": "a prompt long enough for two chunks", "max_tokens": 4,
                      "temperature": 0, "priority": 1},
                headers={"traceparent": parent, "x-gateway-inference-fairness-id": "team-a"}, timeout=60,
            )
            assert resp.status_code == 200, resp.text
            replica_names = ("queue", "prefill", "prefill_chunk", "decode", "text_completion tiny")
            spans = receiver.wait_for({("plimsoll-route", "pick"), ("plimsoll-route", "POST /v1/completions"),
                                       ("plimsoll-serve", "POST /v1/completions"),
                                       *(("plimsoll-serve", n) for n in replica_names)})
        finally:
            router.terminate()
            router.wait(timeout=30)
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    # The replica's warm-up request and the router's probes are traces of their own.
    spans = [s for s in spans if s["trace_id"] == trace_id]
    print("\n".join(f"{s['service']:<15} {s['name']:<24} span {s['span_id']} parent {s['parent'] or '-'}"
                    for s in spans))
    expected = {"POST /v1/completions", "pick", "text_completion tiny", "queue", "prefill", "prefill_chunk", "decode"}
    assert expected <= {s["name"] for s in spans}
    by_id = {s["span_id"]: s for s in spans}
    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    router_span = next(s for s in by_name["POST /v1/completions"] if s["service"] == "plimsoll-route")
    assert router_span["parent"] == "b7ad6b7169203331"  # the caller's span
    assert by_name["pick"][0]["parent"] == router_span["span_id"]
    gen = by_name["text_completion tiny"][0]
    # Up from the engine's span: only replica spans, then the router's span (traceparent propagated).
    hop = by_id[gen["parent"]]
    while hop["service"] == "plimsoll-serve":
        hop = by_id[hop["parent"]]
    assert hop is router_span
    assert any(s["service"] == "plimsoll-serve" and s["parent"] == router_span["span_id"] for s in spans)
    for name in ("queue", "prefill", "decode"):
        assert by_name[name][0]["parent"] == gen["span_id"]
    prefill = by_name["prefill"][0]
    chunks = by_name["prefill_chunk"]
    assert len(chunks) >= 2 and all(c["parent"] == prefill["span_id"] for c in chunks)
    assert sum(c["attrs"]["plimsoll.chunk.tokens"] for c in chunks) == gen["attrs"]["gen_ai.usage.input_tokens"]
    assert gen["attrs"]["gen_ai.request.model"] == "tiny"
    assert gen["attrs"]["gen_ai.usage.output_tokens"] == 4
    assert gen["attrs"]["plimsoll.request.priority"] == 1
    every_value = " ".join(str(v) for s in spans for v in s["attrs"].values())
    assert "a prompt long enough" not in every_value  # no prompt text by default
