"""Parsing real Prometheus exposition (written by prometheus_client) for both engine families."""

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from plimsoll import metric_names as names
from plimsoll.operator.scaling.metrics import (
    Histogram as Hist,
)
from plimsoll.operator.scaling.metrics import (
    MetricsError,
    histogram_quantile,
    merge_histograms,
    parse_scrape,
)


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


HAND = Hist(buckets=((0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (math.inf, 10.0)), count=10.0, sum=5.0)


def test_histogram_quantile_interpolates_like_promql() -> None:
    # rank 5 falls in (0.1, 0.5] holding observations 3..6: 0.1 + 0.4 × (5 − 2) / 4
    assert histogram_quantile(0.5, HAND) == pytest.approx(0.4)
    # rank 1 in the first bucket, which starts at 0
    assert histogram_quantile(0.1, HAND) == pytest.approx(0.05)
    # rank 9.5 in +Inf: the highest finite bound
    assert histogram_quantile(0.95, HAND) == 1.0
    assert histogram_quantile(0.5, Hist(buckets=((1.0, 0.0), (math.inf, 0.0)), count=0, sum=0)) is None
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, HAND)


def test_histogram_quantile_of_a_real_histogram_tracks_the_true_quantile() -> None:
    rng = random.Random(3)
    values = [rng.uniform(0.0, 1.0) for _ in range(5000)]
    s = parse_scrape(plimsoll_scrape(0, 0, 0.0, values))
    assert s.ttft is not None
    true_p95 = sorted(values)[int(0.95 * len(values))]
    # Buckets around 0.95 are (0.75, 1.0]: interpolation of a uniform sample is close.
    assert histogram_quantile(0.95, s.ttft) == pytest.approx(true_p95, abs=0.02)


def test_delta_between_scrapes_and_counter_reset() -> None:
    before = parse_scrape(plimsoll_scrape(0, 0, 0.0, [0.03] * 10)).ttft
    after = parse_scrape(plimsoll_scrape(0, 0, 0.0, [0.03] * 10 + [3.0] * 5)).ttft
    assert before is not None and after is not None
    window = after.delta(before)
    assert window.count == 5 and window.sum == pytest.approx(15.0)
    # All five in (2.5, 5]: rank 2.5 of 5 is halfway through that bucket.
    assert histogram_quantile(0.5, window) == pytest.approx(3.75)
    # A restarted pod's counters are smaller than before: the new values are the window.
    assert before.delta(after) is before


def test_merge_refuses_different_buckets() -> None:
    other = Hist(buckets=((1.0, 1.0), (math.inf, 1.0)), count=1, sum=1)
    with pytest.raises(MetricsError, match="same engine version"):
        merge_histograms([HAND, other])
    merged = merge_histograms([HAND, HAND])
    assert merged is not None and merged.count == 20 and merged.buckets[1] == (0.5, 12.0)
