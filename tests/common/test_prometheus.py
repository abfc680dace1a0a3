"""The shared exposition reader: real prometheus_client text in, samples, histograms and PromQL quantiles out."""

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import Histogram as ClientHistogram

from plimsoll.prometheus import ExpositionError, Histogram, histogram_quantile, merge_histograms, parse

BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0)
HAND = Histogram(buckets=((0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (math.inf, 10.0)), count=10.0, sum=5.0)


def exposition(observations: dict[str, list[float]], buckets: tuple[float, ...] = BUCKETS) -> str:
    """A labelled histogram, a labelled gauge and a counter, as a real server exposes them."""
    registry = CollectorRegistry()
    h = ClientHistogram("lat_seconds", "latency", ["model"], buckets=buckets, registry=registry)
    g = Gauge("queue", "queue", ["model"], registry=registry)
    c = Counter("served", "served", registry=registry)
    for model, values in observations.items():
        for v in values:
            h.labels(model).observe(v)
        g.labels(model).set(len(values))
        c.inc(len(values))
    return generate_latest(registry).decode()


def test_samples_keep_labels_and_sum_over_label_sets() -> None:
    scrape = parse(exposition({"a": [0.2, 0.3], "b": [4.0]}))
    assert sorted(scrape.values("queue")) == [1.0, 2.0]
    assert scrape.sum("queue") == 3.0 and scrape.sum("served_total") == 3.0
    assert scrape.sum("absent") is None and scrape.values("absent") == []
    assert scrape.sums()["queue"] == 3.0 and "lat_seconds_bucket" in scrape.names()


def test_histogram_is_merged_over_label_sets() -> None:
    h = parse(exposition({"a": [0.2, 0.3], "b": [4.0]})).histogram("lat_seconds")
    assert h is not None and h.count == 3 and h.sum == pytest.approx(4.5)
    assert h.buckets == ((0.1, 0.0), (0.5, 2.0), (1.0, 2.0), (2.5, 2.0), (5.0, 3.0), (math.inf, 3.0))
    assert h.mean == pytest.approx(1.5)
    assert parse(exposition({})).histogram("lat_seconds") is None


def test_histogram_quantile_interpolates_like_promql() -> None:
    # rank 5 falls in (0.1, 0.5] holding observations 3..6: 0.1 + 0.4 × (5 − 2) / 4
    assert histogram_quantile(0.5, HAND) == pytest.approx(0.4)
    # rank 1 in the first bucket, which starts at 0
    assert histogram_quantile(0.1, HAND) == pytest.approx(0.05)
    # rank 9.5 in +Inf: the highest finite bound
    assert histogram_quantile(0.95, HAND) == 1.0 == HAND.quantile(0.95)
    empty = Histogram(buckets=((1.0, 0.0), (math.inf, 0.0)), count=0, sum=0)
    assert histogram_quantile(0.5, empty) is None and empty.mean is None
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, HAND)


def test_histogram_quantile_of_a_real_histogram_tracks_the_true_quantile() -> None:
    rng = random.Random(3)
    values = [rng.uniform(0.0, 1.0) for _ in range(5000)]
    h = parse(exposition({"a": values}, buckets=(0.25, 0.5, 0.75, 1.0))).histogram("lat_seconds")
    assert h is not None
    true_p95 = sorted(values)[int(0.95 * len(values))]
    # The bucket around 0.95 is (0.75, 1.0]: interpolation of a uniform sample is close.
    assert histogram_quantile(0.95, h) == pytest.approx(true_p95, abs=0.02)


def test_delta_between_scrapes_and_counter_reset() -> None:
    before = parse(exposition({"a": [0.05] * 10})).histogram("lat_seconds")
    after = parse(exposition({"a": [0.05] * 10 + [3.0] * 5})).histogram("lat_seconds")
    assert before is not None and after is not None
    window = after.delta(before)
    assert window.count == 5 and window.sum == pytest.approx(15.0)
    # All five in (2.5, 5]: rank 2.5 of 5 is halfway through that bucket.
    assert histogram_quantile(0.5, window) == pytest.approx(3.75)
    # A restarted server's counters are smaller than before: the new values are the window.
    assert before.delta(after) is before
    assert after.delta(None) is after


def test_merge_refuses_different_buckets() -> None:
    other = Histogram(buckets=((1.0, 1.0), (math.inf, 1.0)), count=1, sum=1)
    with pytest.raises(ExpositionError, match="same engine version"):
        merge_histograms([HAND, other])
    merged = merge_histograms([HAND, HAND])
    assert merged is not None and merged.count == 20 and merged.buckets[1] == (0.5, 12.0)
    assert merge_histograms([]) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("this is {not prometheus", "not Prometheus text"),
        ('# TYPE h histogram\nh_bucket{le="1.0"} 2\nh_count 2\nh_sum 1\n', r"no \+Inf bucket"),
        ("# TYPE h histogram\nh_bucket 2\nh_count 2\nh_sum 1\n", "numeric 'le'"),
    ],
)
def test_malformed_text_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ExpositionError, match=message):
        parse(text).histogram("h")


def test_only_the_families_asked_for_are_parsed_and_read_the_same() -> None:
    text = (
        '# HELP a_total x\n# TYPE a_total counter\na_total{m="1"} 2.0\na_created{m="1"} 1.0\n'
        '# TYPE h histogram\nh_bucket{le="1.0"} 1.0\nh_bucket{le="+Inf"} 2.0\nh_count 2.0\nh_sum 3.0\n'
        '# TYPE skipped gauge\nskipped{x="1"} 5.0\n'
        '# TYPE i_info gauge\ni_info{version="1.2"} 1.0\n'
    )
    full, part = parse(text), parse(text, only=["a_total", "h", "i_info"])
    assert part.names() == full.names() - {"skipped"}
    assert all(part.samples[n] == full.samples[n] for n in part.names())
    assert part.histogram("h") == full.histogram("h")
    # A line that is no sample at all is still the parser's to refuse, filtered or not.
    with pytest.raises(ExpositionError, match="not Prometheus text"):
        parse("<html>hello</html>\n", only=["a_total"])
