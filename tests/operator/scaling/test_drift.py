"""ProfileDrift's comparison: a replica against its profile's curve over a window (pure, no cluster)."""

import bisect

from plimsoll.metric_names import TOKEN_LATENCY_BUCKETS, TTFT_BUCKETS
from plimsoll.operator.scaling.drift import CurvePoint, DriftTracker, curve_from_status, expected_at
from plimsoll.operator.scaling.metrics import PodSample, parse_scrape
from plimsoll.prometheus import Histogram

CURVE = (
    CurvePoint(concurrency=1, output_tokens_per_s=100.0, ttft_p95_ms=50.0, tpot_p50_ms=10.0),
    CurvePoint(concurrency=4, output_tokens_per_s=400.0, ttft_p95_ms=60.0, tpot_p50_ms=10.0),
    CurvePoint(concurrency=8, output_tokens_per_s=640.0, ttft_p95_ms=90.0, tpot_p50_ms=12.5),
)


def histogram(bounds: tuple[float, ...], values: list[float]) -> Histogram:
    edges = (*bounds, float("inf"))
    counts = [0] * len(edges)
    for v in values:
        counts[bisect.bisect_left(edges, v)] += 1
    cumulative, running = [], 0
    for le, c in zip(edges, counts, strict=True):
        running += c
        cumulative.append((le, float(running)))
    return Histogram(buckets=tuple(cumulative), count=float(len(values)), sum=float(sum(values)))


class Replica:
    """A replica's cumulative counters, advanced one tick at a time."""

    def __init__(self, version: str = "0.1.0") -> None:
        self.ttfts: list[float] = []
        self.tpots: list[float] = []
        self.tokens = 0.0
        self.version = version

    def tick(
        self, *, requests: int, ttft_s: float, tpot_s: float, tokens: float, in_flight: float
    ) -> PodSample:
        self.ttfts += [ttft_s] * requests
        self.tpots += [tpot_s] * requests
        self.tokens += tokens
        return PodSample(
            engine="plimsoll", running=in_flight, waiting=0.0, kv_usage=0.1,
            ttft=histogram(TTFT_BUCKETS, self.ttfts), tpot=histogram(TOKEN_LATENCY_BUCKETS, self.tpots),
            generation_tokens=self.tokens, engine_version=self.version,
        )  # fmt: skip


def test_expected_figures_interpolate_between_levels_and_clamp_at_the_ends() -> None:
    assert expected_at(CURVE, 6.0, "output_tokens_per_s") == 520.0
    assert expected_at(CURVE, 0.5, "ttft_p95_ms") == 50.0
    assert expected_at(CURVE, 20.0, "tpot_p50_ms") == 12.5
    assert expected_at((), 3.0, "ttft_p95_ms") is None


def feed(tracker: DriftTracker, replica: Replica, start: float, seconds: float, **tick: float) -> float:
    """Ten-second ticks from ``start`` for ``seconds``; returns the time of the last one."""
    t = start
    while t <= start + seconds:
        tracker.observe(t, {"pod-a": replica.tick(**tick)})  # type: ignore[arg-type]
        t += 10.0
    return t - 10.0


def test_a_replica_that_matches_its_profile_is_not_drifting() -> None:
    tracker = DriftTracker(curve=CURVE, margin=0.25, window_s=60.0, min_requests=10)
    # At 4 in flight the profile says 400 tokens/s, TTFT p95 60 ms, TPOT p50 10 ms.
    t = feed(tracker, Replica(), 0.0, 70.0, requests=5, ttft_s=0.055, tpot_s=0.0095, tokens=4000, in_flight=4)
    verdict = tracker.verdict(t)
    assert (verdict.status, verdict.reason) == ("False", "MatchesProfile")
    assert "output tokens/s 400 vs profile 400" in verdict.message


def test_a_replica_that_slows_down_drifts_only_once_the_slow_window_is_full() -> None:
    tracker = DriftTracker(curve=CURVE, margin=0.25, window_s=60.0, min_requests=10)
    replica = Replica()
    t = feed(tracker, replica, 0.0, 70.0, requests=5, ttft_s=0.055, tpot_s=0.0095, tokens=4000, in_flight=4)
    assert tracker.verdict(t).status == "False"
    # The step cost doubles: half the tokens, twice the per-token time.
    slow = dict(requests=5, ttft_s=0.110, tpot_s=0.019, tokens=2000, in_flight=4)
    t = feed(tracker, replica, t + 10, 30.0, **slow)
    assert tracker.verdict(t).status is None, "off for less than a window: nothing new to say yet"
    # A burst of normal speed inside the slow spell starts the count again.
    t = feed(
        tracker, replica, t + 10, 20.0, requests=5, ttft_s=0.055, tpot_s=0.0095, tokens=4000, in_flight=4
    )
    t = feed(tracker, replica, t + 10, 30.0, **slow)
    # The first slow slice (20 s) started inside the burst: off since 50 s before now.
    assert tracker.verdict(t).status is None, "off for 50 s is less than the 60 s window"
    t = feed(tracker, replica, t + 10, 0.0, **slow)
    verdict = tracker.verdict(t)
    assert (verdict.status, verdict.reason) == ("True", "BehaviourChanged")
    (comparison,) = verdict.drifted
    off = comparison.off()
    # TTFT's bucket (100..250 ms) lies wholly above 60 × 1.25; TPOT's (10..25 ms) holds the profile's 10 ms.
    assert off["output tokens/s"] == -0.5 and off["TTFT p95 ms"] > 0.25 and "TPOT p50 ms" not in off, off
    assert "pod pod-a" in verdict.message and "output tokens/s 200 vs profile 400 (-50%)" in verdict.message


def test_too_little_traffic_says_nothing_new() -> None:
    tracker = DriftTracker(curve=CURVE, margin=0.25, window_s=60.0, min_requests=10)
    t = feed(tracker, Replica(), 0.0, 70.0, requests=1, ttft_s=0.5, tpot_s=0.1, tokens=10, in_flight=1)
    verdict = tracker.verdict(t)
    assert verdict.status is None and verdict.reason == "NotEnoughTraffic"


def test_a_changed_engine_version_is_drift_whatever_the_speed() -> None:
    tracker = DriftTracker(curve=CURVE, margin=0.25, window_s=60.0)
    tick = dict(requests=5, ttft_s=0.055, tpot_s=0.0095, tokens=4000, in_flight=4)
    tracker.observe(0.0, {"pod-a": Replica("0.1.0").tick(**tick)})  # type: ignore[arg-type]
    tracker.observe(10.0, {"pod-b": Replica("0.2.0").tick(**tick)})  # type: ignore[arg-type]
    verdict = tracker.verdict(10.0)
    assert (verdict.status, verdict.reason) == ("True", "EngineVersionChanged")
    assert "pod-b reports engine version 0.2.0" in verdict.message and "measured on 0.1.0" in verdict.message


def test_the_curve_round_trips_through_status_and_the_scrape_carries_version_and_tokens() -> None:
    status = {"curve": [p.to_status() for p in reversed(CURVE)]}
    assert curve_from_status(status) == CURVE
    text = (
        "# TYPE plimsoll_num_requests_running gauge\nplimsoll_num_requests_running 2\n"
        "# TYPE plimsoll_num_requests_waiting gauge\nplimsoll_num_requests_waiting 1\n"
        '# TYPE plimsoll_generation_tokens counter\nplimsoll_generation_tokens_total{model_name="m"} 1234\n'
        '# TYPE plimsoll_build info\nplimsoll_build_info{version="0.3.1"} 1\n'
    )
    sample = parse_scrape(text)
    assert (sample.generation_tokens, sample.engine_version) == (1234.0, "0.3.1")
