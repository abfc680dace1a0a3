"""Must-show 3: `diagnose` names the limiting layer in four synthetic metric scenarios.

The metrics are real Prometheus exposition (prometheus_client) served over real
HTTP; one scenario uses vLLM's series names, the rest plimsoll's.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from typer.testing import CliRunner

from plimsoll import metric_names as mn
from plimsoll.bench.diagnose import analyse, observe
from plimsoll.bench.scrape import parse_metrics
from plimsoll.cli import app
from plimsoll.metric_names import EngineMetricNames


@dataclass
class Scenario:
    requests: int = 40
    queue_s: float = 0.01
    prefill_s: float = 0.05
    tpots_s: tuple[float, ...] = (0.03,)
    running: float = 4
    waiting: float = 0
    kv: float = 0.3
    preemptions: int = 0
    alloc_failures: int = 0


SCENARIOS = {
    "queueing": Scenario(queue_s=2.0, prefill_s=0.1, running=16, waiting=12, kv=0.5),
    "prefill": Scenario(queue_s=0.05, prefill_s=1.5, running=4, kv=0.3),
    "decode": Scenario(tpots_s=(0.05, 0.06, 0.25, 0.3), running=32, kv=0.6),
    # KV exhaustion also builds a queue; the verdict must name the root cause.
    "kv_capacity": Scenario(
        queue_s=1.0, prefill_s=0.1, running=8, waiting=8, kv=0.99, preemptions=20, alloc_failures=5
    ),
}


def timeline(fam: EngineMetricNames, s: Scenario) -> list[str]:
    """Exposition text before and after the window's traffic."""
    reg = CollectorRegistry()

    def hist(name: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, name, buckets=buckets, registry=reg)

    running = Gauge(fam.running, "running", registry=reg)
    waiting = Gauge(fam.waiting, "waiting", registry=reg)
    kv = Gauge(fam.kv_usage, "kv", registry=reg)
    ttft = hist(fam.ttft, mn.TTFT_BUCKETS)
    queue = hist(fam.queue_time, mn.REQUEST_LATENCY_BUCKETS)
    prefill = hist(fam.prefill_time, mn.REQUEST_LATENCY_BUCKETS)
    tpot = hist(fam.tpot, mn.TOKEN_LATENCY_BUCKETS)
    pre = Counter(fam.preemptions.removesuffix("_total"), "preemptions", registry=reg)
    alloc = None
    if fam is mn.PLIMSOLL:
        alloc = Counter(mn.KV_CACHE_ALLOCATION_FAILURES.removesuffix("_total"), "alloc", registry=reg)
    texts = [generate_latest(reg).decode()]
    running.set(s.running)
    waiting.set(s.waiting)
    kv.set(s.kv)
    for i in range(s.requests):
        queue.observe(s.queue_s)
        prefill.observe(s.prefill_s)
        ttft.observe(s.queue_s + s.prefill_s)
        tpot.observe(s.tpots_s[i % len(s.tpots_s)])
    pre.inc(s.preemptions)
    if alloc is not None:
        alloc.inc(s.alloc_failures)
    texts.append(generate_latest(reg).decode())
    return texts


@contextmanager
def metrics_server(texts: list[str]) -> Iterator[str]:
    """Serve the texts in order on /metrics (the last one repeats)."""
    served = {"n": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = texts[min(served["n"], len(texts) - 1)].encode()
            served["n"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("layer", list(SCENARIOS))
async def test_diagnose_names_the_limiting_layer(layer: str) -> None:
    fam = mn.VLLM if layer == "decode" else mn.PLIMSOLL
    with metrics_server(timeline(fam, SCENARIOS[layer])) as url:
        samples = await observe(url, window_s=0.2, interval_s=0.1)
    d = analyse(samples)
    assert d.verdict == layer, d.summary
    assert d.engine_family == ("vllm" if fam is mn.VLLM else "plimsoll")
    top = d.findings[0]
    assert top.layer == layer and top.evidence and top.advice
    # the other scenarios' layers are not blamed first
    assert all(f.layer != layer for f in d.findings[1:])


def test_queue_scenario_evidence_is_quantified() -> None:
    texts = timeline(mn.PLIMSOLL, SCENARIOS["queueing"])
    d = analyse([parse_metrics(texts[0], t=0.0), parse_metrics(texts[1], t=10.0)])
    assert d.observed["queue_mean_s"] == pytest.approx(2.0)
    assert d.observed["ttft_mean_s"] == pytest.approx(2.1)
    assert "95%" in d.findings[0].evidence[0]  # 2.0 of 2.1 s


def test_idle_and_healthy_servers() -> None:
    idle = timeline(mn.PLIMSOLL, Scenario(requests=0, running=0))
    assert analyse([parse_metrics(t, t=i) for i, t in enumerate(idle)]).verdict == "no_traffic"
    healthy = timeline(mn.PLIMSOLL, Scenario())
    assert analyse([parse_metrics(t, t=i) for i, t in enumerate(healthy)]).verdict == "none"


def test_diagnose_cli_prints_verdict_and_advice() -> None:
    with metrics_server(timeline(mn.PLIMSOLL, SCENARIOS["prefill"])) as url:
        result = CliRunner().invoke(app, ["diagnose", "--url", url, "--window", "0.2", "--interval", "0.1"])
    assert result.exit_code == 0, result.output
    assert "verdict: prefill" in result.output
    assert "prefix caching" in result.output


def test_observe_takes_two_scrapes_even_when_one_outlasts_the_window() -> None:
    # A window shorter than one scrape (a busy host) still yields the two scrapes analyse needs.
    import asyncio

    from plimsoll.bench.diagnose import observe

    with metrics_server(timeline(mn.PLIMSOLL, SCENARIOS["prefill"])) as url:
        samples = asyncio.run(observe(url, window_s=1e-9, interval_s=0.05))
    assert len(samples) == 2


def test_diagnose_cli_unreachable_url_fails_clearly() -> None:
    result = CliRunner().invoke(app, ["diagnose", "--url", "http://127.0.0.1:9", "--window", "0.1"])
    assert result.exit_code != 0
    assert "cannot read" in result.output


def test_slow_decode_on_plimsoll_points_at_plimsoll_profile() -> None:
    texts = timeline(mn.PLIMSOLL, SCENARIOS["decode"])
    d = analyse([parse_metrics(t, t=i * 10.0) for i, t in enumerate(texts)])
    assert d.verdict == "decode", d.summary
    tips = d.findings[0].advice
    assert sum("plimsoll profile --url" in t for t in tips) == 1
    texts = timeline(mn.VLLM, SCENARIOS["decode"])
    vllm = analyse([parse_metrics(t, t=i * 10.0) for i, t in enumerate(texts)])
    assert not any("plimsoll profile" in t for t in vllm.findings[0].advice)  # vLLM has its own profiler
