"""SLOAtRisk from the pods' own TTFT/TPOT histograms, over the window between two scrapes."""

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from plimsoll import metric_names as names
from plimsoll.operator.scaling.metrics import PodSample, parse_scrape
from plimsoll.operator.scaling.slo import check_slo


class Replica:
    """A registry with the runtime's series, observed like a serving replica would."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        Gauge(names.NUM_REQUESTS_RUNNING, "r", registry=self.registry)
        Gauge(names.NUM_REQUESTS_WAITING, "w", registry=self.registry)
        self.ttft = Histogram(
            names.TIME_TO_FIRST_TOKEN, "t", buckets=names.TTFT_BUCKETS, registry=self.registry
        )
        self.tpot = Histogram(
            names.TIME_PER_OUTPUT_TOKEN, "p", buckets=names.TOKEN_LATENCY_BUCKETS, registry=self.registry
        )

    def serve(self, n: int, ttft_s: float, tpot_s: float) -> None:
        for _ in range(n):
            self.ttft.observe(ttft_s)
            self.tpot.observe(tpot_s)

    def scrape(self) -> PodSample:
        return parse_scrape(generate_latest(self.registry).decode())


def test_slow_window_after_a_fast_history_is_at_risk() -> None:
    a, b = Replica(), Replica()
    a.serve(500, 0.05, 0.02)  # long fast history must not hide the slow window
    b.serve(500, 0.05, 0.02)
    before = {"a": a.scrape(), "b": b.scrape()}
    a.serve(30, 1.5, 0.02)
    b.serve(30, 1.5, 0.02)
    check = check_slo(
        ttft_p95_ms=500, tpot_p50_ms=50, current={"a": a.scrape(), "b": b.scrape()}, previous=before
    )
    assert check.status == "True" and check.reason == "SLOBreached"
    assert check.requests == 60
    # All window observations sit in (1.0, 2.5]: p95 = 1.0 + 1.5 × 0.95 = 2.425 s.
    assert check.ttft_p95_ms == pytest.approx(2425)
    assert "TTFT p95 2425 ms vs SLO 500 ms" in check.message
    assert "TPOT p50" in check.message


def test_fast_window_is_within_slo_and_quiet_window_is_unknown() -> None:
    a = Replica()
    a.serve(100, 0.05, 0.02)
    before = {"a": a.scrape()}
    a.serve(40, 0.07, 0.03)
    check = check_slo(ttft_p95_ms=500, tpot_p50_ms=50, current={"a": a.scrape()}, previous=before)
    assert (check.status, check.reason) == ("False", "WithinSLO")
    assert check.ttft_p95_ms is not None and check.ttft_p95_ms <= 80
    quiet = check_slo(
        ttft_p95_ms=500, tpot_p50_ms=None, current={"a": a.scrape()}, previous={"a": a.scrape()}
    )
    assert (quiet.status, quiet.reason) == ("Unknown", "NotEnoughTraffic")


def test_a_new_pod_counts_with_its_whole_history_and_no_slo_means_false() -> None:
    a = Replica()
    a.serve(25, 0.9, 0.2)
    check = check_slo(ttft_p95_ms=None, tpot_p50_ms=100, current={"a": a.scrape()}, previous={})
    assert check.status == "True" and check.tpot_p50_ms is not None and check.tpot_p50_ms > 100
    assert check_slo(ttft_p95_ms=None, tpot_p50_ms=None, current={}, previous={}).reason == "NoSLO"
