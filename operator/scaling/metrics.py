"""Reading one replica's ``/metrics`` scrape into the numbers the autoscaler uses.

What it is: a parser from Prometheus text exposition (``prometheus_client.parser``)
to a :class:`PodSample` — running and waiting requests, KV-cache usage, and the
TTFT and TPOT histograms — for either engine family in
:mod:`plimsoll.metric_names` (``plimsoll_*`` or ``vllm:*``); plus histogram deltas
between two scrapes and ``histogram_quantile`` as Prometheus computes it.

What it is not: it does not fetch anything. The handler scrapes; this reads text.
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from plimsoll.metric_names import ENGINE_FAMILIES, detect_family


class MetricsError(ValueError):
    """A scrape that cannot be read as engine metrics; the message says why."""


@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative Prometheus histogram: ``buckets`` are ``(le, count)`` pairs, ascending, ending at +Inf."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def delta(self, earlier: "Histogram | None") -> "Histogram":
        """Observations made since ``earlier``; a counter reset (restarted pod) counts from zero, as ``rate()`` does."""
        if earlier is None or earlier.count > self.count or _bounds(earlier) != _bounds(self):
            return self
        return Histogram(
            buckets=tuple(
                (le, c - ec) for (le, c), (_, ec) in zip(self.buckets, earlier.buckets, strict=True)
            ),
            count=self.count - earlier.count,
            sum=self.sum - earlier.sum,
        )


def _bounds(h: Histogram) -> tuple[float, ...]:
    return tuple(le for le, _ in h.buckets)


def merge_histograms(histograms: Iterable[Histogram]) -> Histogram | None:
    """Bucket-wise sum of histograms with the same bounds (several pods, or several label sets)."""
    merged: Histogram | None = None
    for h in histograms:
        if merged is None:
            merged = h
            continue
        if _bounds(h) != _bounds(merged):
            raise MetricsError(
                f"cannot merge histograms with different buckets: {_bounds(merged)} vs {_bounds(h)}; "
                "all replicas of one service must run the same engine version"
            )
        merged = Histogram(
            buckets=tuple((le, a + b) for (le, a), (_, b) in zip(merged.buckets, h.buckets, strict=True)),
            count=merged.count + h.count,
            sum=merged.sum + h.sum,
        )
    return merged


def histogram_quantile(q: float, h: Histogram) -> float | None:
    """The q-quantile the way PromQL's ``histogram_quantile`` estimates it; None when there are no observations.

    Linear interpolation inside the bucket holding the rank, the first bucket
    starting at 0; a rank in the +Inf bucket returns the highest finite bound.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    if h.count <= 0 or not h.buckets:
        return None
    rank = q * h.count
    lower_bound, lower_count = 0.0, 0.0
    for le, cumulative in h.buckets:
        if cumulative >= rank:
            if math.isinf(le):
                return lower_bound
            in_bucket = cumulative - lower_count
            if in_bucket <= 0:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / in_bucket
        lower_bound, lower_count = le, cumulative
    return lower_bound


@dataclass(frozen=True, slots=True)
class PodSample:
    """One scrape of one replica, in engine-neutral terms."""

    engine: str  # key of ENGINE_FAMILIES: "plimsoll" or "vllm"
    running: float
    waiting: float
    kv_usage: float | None  # 0..1
    ttft: Histogram | None
    tpot: Histogram | None

    @property
    def in_flight(self) -> float:
        """Requests the replica holds: running plus waiting (the autoscaler's per-pod metric)."""
        return self.running + self.waiting


def parse_scrape(text: str) -> PodSample:
    """Read a replica's exposition text; raise :class:`MetricsError` when it is not engine metrics."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as err:
        raise MetricsError(f"not Prometheus text exposition: {err}") from err
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in families:
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    engine = detect_family(set(samples))
    if engine is None:
        expected = ", ".join(f"{f.running} ({key})" for key, f in ENGINE_FAMILIES.items())
        raise MetricsError(
            f"no engine gauges in the scrape (looked for {expected}); is the pod running plimsoll or vLLM "
            "and serving /metrics on this port?"
        )
    engine_key = next(key for key, f in ENGINE_FAMILIES.items() if f is engine)
    running = _gauge_sum(samples, engine.running)
    waiting = _gauge_sum(samples, engine.waiting)
    if running is None or waiting is None:
        missing = engine.running if running is None else engine.waiting
        raise MetricsError(
            f"the scrape has no {missing} gauge; the autoscaler needs both running and waiting"
        )
    kv_values = [value for _, value in samples.get(engine.kv_usage, [])]
    return PodSample(
        engine=engine_key,
        running=running,
        waiting=waiting,
        # Several engines behind one pod (data parallel) report one ratio each; the fullest one limits.
        kv_usage=max(kv_values) if kv_values else None,
        ttft=_histogram(samples, engine.ttft),
        tpot=_histogram(samples, engine.tpot),
    )


def _gauge_sum(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    values = samples.get(name)
    if values is None:
        return None
    # One series per model or engine label set; the pod holds them all.
    return sum(value for _, value in values)


def _histogram(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> Histogram | None:
    bucket_rows = samples.get(f"{name}_bucket")
    if not bucket_rows:
        return None
    # Group by the label set without `le`, then merge the groups.
    groups: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    for labels, value in bucket_rows:
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        try:
            le = float(labels["le"])
        except (KeyError, ValueError) as err:
            raise MetricsError(f"{name}_bucket has a sample without a numeric 'le' label: {labels}") from err
        groups.setdefault(key, []).append((le, value))
    counts = {tuple(sorted(labels.items())): value for labels, value in samples.get(f"{name}_count", [])}
    sums = {tuple(sorted(labels.items())): value for labels, value in samples.get(f"{name}_sum", [])}
    histograms = []
    for key, rows in groups.items():
        buckets = tuple(sorted(rows))
        if not math.isinf(buckets[-1][0]):
            raise MetricsError(f"{name} has no +Inf bucket; the exposition is truncated or malformed")
        histograms.append(
            Histogram(buckets=buckets, count=counts.get(key, buckets[-1][1]), sum=sums.get(key, 0.0))
        )
    return merge_histograms(histograms)


__all__ = [
    "Histogram",
    "MetricsError",
    "PodSample",
    "histogram_quantile",
    "merge_histograms",
    "parse_scrape",
]
