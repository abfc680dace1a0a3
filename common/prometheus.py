"""Reading Prometheus text exposition: samples by name, histograms, and PromQL's quantile.

What it is: the one reader of ``/metrics`` text for bench, diagnose, the router
and the operator's autoscaler. :func:`parse` runs prometheus_client's own parser
and keeps every sample with its labels (:class:`Scrape`); a :class:`Histogram`
is rebuilt from the ``_bucket``/``_count``/``_sum`` series, merged over label
sets; :meth:`Histogram.delta` is what it observed between two scrapes, the way
``rate()`` treats a counter reset; :func:`histogram_quantile` estimates a
quantile as PromQL does. Which series to read (plimsoll's or vLLM's spelling)
is :mod:`plimsoll.metric_names`' business.

What it is not: a scraper or a store. Nothing here does I/O (the operator's pure
layers use it); callers fetch the text and keep what they need.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = dict[str, str]


class ExpositionError(ValueError):
    """Text that cannot be read as the series asked for; the message says why."""


@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative histogram: ``buckets`` are ``(le, count)`` pairs, ascending, ending at +Inf."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    @property
    def bounds(self) -> tuple[float, ...]:
        return tuple(le for le, _ in self.buckets)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def delta(self, earlier: Histogram | None) -> Histogram:
        """Observations made since ``earlier``; a counter reset (a restarted server) counts from zero, as ``rate()`` does."""
        if earlier is None or earlier.count > self.count or earlier.bounds != self.bounds:
            return self
        return Histogram(
            buckets=tuple(
                (le, c - ec) for (le, c), (_, ec) in zip(self.buckets, earlier.buckets, strict=True)
            ),
            count=self.count - earlier.count,
            sum=self.sum - earlier.sum,
        )

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self)


def counter_increase(now: float, before: float) -> float:
    """What a counter added since ``before``; a reset (a restarted server) counts from zero, as ``rate()`` does."""
    return now if now < before else now - before


def merge_histograms(histograms: Iterable[Histogram]) -> Histogram | None:
    """Bucket-wise sum of histograms with the same bounds (several servers, or several label sets)."""
    merged: Histogram | None = None
    for h in histograms:
        if merged is None:
            merged = h
            continue
        if h.bounds != merged.bounds:
            raise ExpositionError(
                f"cannot merge histograms with different buckets: {merged.bounds} vs {h.bounds}; "
                "the series merged (all replicas of one service) must come from the same engine version"
            )
        merged = Histogram(
            buckets=tuple((le, a + b) for (le, a), (_, b) in zip(merged.buckets, h.buckets, strict=True)),
            count=merged.count + h.count,
            sum=merged.sum + h.sum,
        )
    return merged


def histogram_quantile(q: float, h: Histogram) -> float | None:
    """The q-quantile the way PromQL's ``histogram_quantile`` estimates it; None without observations.

    Linear interpolation inside the bucket holding the rank q·count, the first
    bucket starting at 0; a rank in the +Inf bucket returns the highest finite bound.
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
class Scrape:
    """One exposition: sample name (with its ``_total``/``_bucket`` suffix) -> every (labels, value)."""

    samples: dict[str, list[tuple[Labels, float]]]

    def names(self) -> set[str]:
        return set(self.samples)

    def values(self, name: str) -> list[float]:
        return [value for _, value in self.samples.get(name, [])]

    def sum(self, name: str) -> float | None:
        """The series summed over its label sets (one per model or engine); None when absent."""
        rows = self.samples.get(name)
        return None if rows is None else sum(value for _, value in rows)

    def sums(self) -> dict[str, float]:
        """Every sample name summed over its label sets."""
        return {name: sum(value for _, value in rows) for name, rows in self.samples.items()}

    def histogram(self, name: str) -> Histogram | None:
        """Histogram ``name`` (without suffix) merged over its label sets; None when absent."""
        bucket_rows = self.samples.get(f"{name}_bucket")
        if not bucket_rows:
            return None
        groups: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
        for labels, value in bucket_rows:
            try:
                le = float(labels["le"])
            except (KeyError, ValueError) as err:
                raise ExpositionError(
                    f"{name}_bucket has a sample without a numeric 'le' label: {labels}"
                ) from err
            groups.setdefault(_key(labels), []).append((le, value))
        counts = {_key(labels): value for labels, value in self.samples.get(f"{name}_count", [])}
        sums = {_key(labels): value for labels, value in self.samples.get(f"{name}_sum", [])}
        histograms = []
        for key, rows in groups.items():
            buckets = tuple(sorted(rows))
            if not math.isinf(buckets[-1][0]):
                raise ExpositionError(f"{name} has no +Inf bucket; the exposition is truncated or malformed")
            histograms.append(
                Histogram(buckets=buckets, count=counts.get(key, buckets[-1][1]), sum=sums.get(key, 0.0))
            )
        return merge_histograms(histograms)


def _key(labels: Labels) -> tuple[tuple[str, str], ...]:
    """A label set without ``le``: the series a bucket, its count and its sum share."""
    return tuple(sorted((k, v) for k, v in labels.items() if k != "le"))


_SUFFIXES = ("", "_total", "_created", "_info", "_bucket", "_count", "_sum")
# A sample line: name, optional labels, value, optional timestamp.
_SAMPLE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})?[ \t]+\S+([ \t]+\S+)?")


def _family(name: str) -> str:
    for suffix in _SUFFIXES[1:]:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def _only(text: str, names: Collection[str]) -> str:
    """The lines of ``text`` that belong to the families of ``names`` (and any line that is no sample)."""
    wanted = {_family(n) + suffix for n in names for suffix in _SUFFIXES}
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE") or parts[2] in wanted:
                kept.append(line)
            continue
        name = line.partition("{")[0].partition(" ")[0]
        # A line that is no sample stays: the parser then says what is wrong with the text.
        if name in wanted or not _SAMPLE.fullmatch(line):
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse(text: str, only: Collection[str] | None = None) -> Scrape:
    """Read exposition text; raise :class:`ExpositionError` when it is not Prometheus text format.

    With ``only`` (sample or family names), every other family's lines are skipped
    before parsing: a replica exports hundreds of lines and a reader such as the
    operator needs a few dozen, and parsing is most of what reading a scrape costs.
    """
    if only is not None:
        text = _only(text, only)
    samples: dict[str, list[tuple[Labels, float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    except ValueError as err:
        raise ExpositionError(f"not Prometheus text exposition: {err}") from err
    return Scrape(samples)


__all__ = [
    "ExpositionError",
    "Histogram",
    "Scrape",
    "histogram_quantile",
    "merge_histograms",
    "parse",
]
