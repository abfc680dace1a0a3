"""The autoscaler's reading of real exposition (written by prometheus_client) for both engine families.

Histograms and quantiles themselves are tested with plimsoll.prometheus (tests/common/test_prometheus.py).
"""

import math

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from plimsoll import metric_names as names
from plimsoll.operator.scaling.metrics import READ, MetricsError, parse_scrape


def plimsoll_scrape(running: int, waiting: int, kv: float, ttfts: list[float]) -> str:
    registry = CollectorRegistry()
    Gauge(names.NUM_REQUESTS_RUNNING, "running", registry=registry).set(running)
    Gauge(names.NUM_REQUESTS_WAITING, "waiting", registry=registry).set(waiting)
    Gauge(names.KV_CACHE_USAGE_RATIO, "kv", registry=registry).set(kv)
    ttft = Histogram(names.TIME_TO_FIRST_TOKEN, "ttft", buckets=names.TTFT_BUCKETS, registry=registry)
    for value in ttfts:
        ttft.observe(value)
    return generate_latest(registry).decode()


def vllm_scrape() -> str:
    registry = CollectorRegistry()
    running = Gauge(names.VLLM.running, "running", ["model_name"], registry=registry)
    waiting = Gauge(names.VLLM.waiting, "waiting", ["model_name"], registry=registry)
    kv = Gauge(names.VLLM.kv_usage, "kv", ["model_name"], registry=registry)
    tpot = Histogram(
        names.VLLM.tpot, "tpot", ["model_name"], buckets=names.TOKEN_LATENCY_BUCKETS, registry=registry
    )
    for model, (r, w, k) in {"a": (3, 1, 0.4), "b": (2, 4, 0.7)}.items():
        running.labels(model).set(r)
        waiting.labels(model).set(w)
        kv.labels(model).set(k)
        tpot.labels(model).observe(0.02 if model == "a" else 0.06)
    return generate_latest(registry).decode()


def test_plimsoll_scrape_gives_in_flight_kv_and_histogram() -> None:
    s = parse_scrape(plimsoll_scrape(5, 3, 0.42, [0.03, 0.3, 3.0]))
    assert (s.engine, s.running, s.waiting, s.in_flight) == ("plimsoll", 5, 3, 8)
    assert s.kv_usage == pytest.approx(0.42)
    assert s.ttft is not None and s.ttft.count == 3 and s.ttft.sum == pytest.approx(3.33)
    assert math.isinf(s.ttft.buckets[-1][0]) and len(s.ttft.buckets) == len(names.TTFT_BUCKETS) + 1
    assert s.tpot is None


def test_a_split_pools_signals_are_read_where_exported() -> None:
    registry = CollectorRegistry()
    Gauge(names.NUM_REQUESTS_RUNNING, "running", registry=registry).set(1)
    Gauge(names.NUM_REQUESTS_WAITING, "waiting", registry=registry).set(2)
    Gauge(names.KV_CACHE_USAGE_RATIO, "kv", registry=registry).set(0.1)
    Gauge(names.PREFILL_BACKLOG_TOKENS, "backlog", ["model_name"], registry=registry).labels("m").set(1536)
    Gauge(names.KV_CACHE_BYTES_PER_TOKEN, "bytes", ["model_name"], registry=registry).labels("m").set(4096)
    s = parse_scrape(generate_latest(registry).decode())
    assert (s.prefill_backlog_tokens, s.kv_bytes_per_token) == (1536, 4096)
    # vLLM exports neither: the prefill pool's signal is then missing, not zero.
    v = parse_scrape(vllm_scrape())
    assert (v.prefill_backlog_tokens, v.kv_bytes_per_token) == (None, None)


def test_vllm_scrape_sums_label_sets() -> None:
    s = parse_scrape(vllm_scrape())
    assert (s.engine, s.running, s.waiting) == ("vllm", 5, 5)
    assert s.kv_usage == pytest.approx(0.7)  # the fullest engine limits the pod
    assert s.tpot is not None and s.tpot.count == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# TYPE http_requests_total counter\nhttp_requests_total 4\n", "no engine gauges"),
        (
            f"# TYPE {names.NUM_REQUESTS_RUNNING} gauge\n{names.NUM_REQUESTS_RUNNING} 1\n",
            "num_requests_waiting",
        ),
        ("this is {not prometheus", "not Prometheus text"),
    ],
)
def test_unreadable_scrapes_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(MetricsError, match=message):
        parse_scrape(text)


def test_reading_only_the_series_used_gives_what_the_whole_exposition_says() -> None:
    """The runtime's full /metrics (every family filled) read as the planner reads it, and read whole."""
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as ClientCounter
    from prometheus_client import Histogram as ClientHistogram

    from plimsoll import metric_names as mn
    from plimsoll.prometheus import parse
    from plimsoll.runtime.serving.metrics import ServerMetrics

    metrics = ServerMetrics("m", CollectorRegistry())
    for i, family in enumerate(vars(metrics).values()):
        if isinstance(family, ClientHistogram) and family._labelnames == ("model_name",):
            for v in (0.01, 0.2, 3.0)[: 1 + i % 3]:
                family.labels("m").observe(v)
        elif isinstance(family, ClientCounter) and family._labelnames == ("model_name",):
            family.labels("m").inc(i + 1)
    metrics.running.labels("m").set(3)
    metrics.waiting.labels("m").set(2)
    text = metrics.exposition()[0].decode()
    sample, whole = parse_scrape(text), parse(text)
    assert len(text.splitlines()) > 3 * len(parse(text, only=READ).sums())  # most of it is skipped
    assert (sample.running, sample.waiting) == (
        whole.sum(mn.NUM_REQUESTS_RUNNING),
        whole.sum(mn.NUM_REQUESTS_WAITING),
    )
    assert sample.ttft == whole.histogram(mn.TIME_TO_FIRST_TOKEN) and sample.ttft is not None
    assert sample.tpot == whole.histogram(mn.TIME_PER_OUTPUT_TOKEN) and sample.tpot is not None
    assert sample.generation_tokens == whole.sum(mn.GENERATION_TOKENS) is not None
    assert sample.requests_finished == whole.sum(mn.REQUEST_SUCCESS)
    assert sample.requests_cut == whole.sum(mn.REQUESTS_CUT_BY_SHUTDOWN) is not None
    assert sample.engine_version == whole.samples[mn.BUILD_INFO][0][0]["version"]
