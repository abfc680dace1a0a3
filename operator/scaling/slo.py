"""The ``SLOAtRisk`` check: do the replicas' own latency histograms break the spec's SLO?

What it is: TTFT p95 and TPOT p50 computed, as PromQL's ``histogram_quantile``
would, from the bucket deltas between two scrapes of every ready pod (so only
requests finished in that window count), compared with ``spec.slo``.

What it is not: a measure of what clients see end to end (the router and the
network add to it), and it does not keep history; the handler keeps the
previous scrape.
"""

from collections.abc import Mapping
from dataclasses import dataclass

from plimsoll.operator.scaling.formula import fmt
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.prometheus import Histogram, histogram_quantile, merge_histograms

# Fewer finished requests than this in a window say little about a p95.
MIN_REQUESTS = 20
# Below this 1-minute attainment the service is at risk even while its percentiles hold.
AT_RISK_ATTAINMENT = 0.99


@dataclass(frozen=True, slots=True)
class SLOCheck:
    """The SLOAtRisk condition's content."""

    status: str  # "True" (at risk), "False" or "Unknown"
    reason: str
    message: str
    ttft_p95_ms: float | None
    tpot_p50_ms: float | None
    requests: float


def _window(
    current: Mapping[str, PodSample], previous: Mapping[str, PodSample], pick: str
) -> Histogram | None:
    deltas = []
    for name, sample in current.items():
        now = getattr(sample, pick)
        if now is None:
            continue
        before = previous.get(name)
        deltas.append(now.delta(getattr(before, pick) if before is not None else None))
    return merge_histograms(deltas)


def check_slo(
    *,
    ttft_p95_ms: float | None,
    tpot_p50_ms: float | None,
    current: Mapping[str, PodSample],
    previous: Mapping[str, PodSample],
    min_requests: float = MIN_REQUESTS,
    attainment: float | None = None,
) -> SLOCheck:
    """Compare the window's quantiles with the objectives; ``Unknown`` when there is too little traffic.

    A pod absent from ``previous`` (new, or restarted) contributes its whole
    histogram, as Prometheus' ``increase()`` treats a fresh counter.
    ``attainment`` (the last minute's fraction of good requests, when the
    replicas judge them) is quoted, and below :data:`AT_RISK_ATTAINMENT` it
    makes the service at risk (reason ``AttainmentLow``) though every
    percentile holds: a p95 objective met by 96% of requests has little room left.
    """
    if ttft_p95_ms is None and tpot_p50_ms is None:
        return SLOCheck("False", "NoSLO", "spec.slo sets no TTFT or TPOT objective", None, None, 0.0)
    ttft = _window(current, previous, "ttft")
    tpot = _window(current, previous, "tpot")
    requests = ttft.count if ttft is not None else 0.0
    if requests < min_requests:
        return SLOCheck(
            "Unknown",
            "NotEnoughTraffic",
            f"{fmt(requests)} requests in the window; at least {fmt(min_requests)} are needed for a percentile",
            None,
            None,
            requests,
        )
    ttft_q = histogram_quantile(0.95, ttft) if ttft is not None else None
    tpot_q = histogram_quantile(0.50, tpot) if tpot is not None else None
    ttft_ms = ttft_q * 1000 if ttft_q is not None else None
    tpot_ms = tpot_q * 1000 if tpot_q is not None else None
    broken: list[str] = []
    kept: list[str] = []
    for label, value, limit in (("TTFT p95", ttft_ms, ttft_p95_ms), ("TPOT p50", tpot_ms, tpot_p50_ms)):
        if limit is None or value is None:
            continue
        text = f"{label} {fmt(value)} ms vs SLO {fmt(limit)} ms"
        (broken if value > limit else kept).append(text)
    if attainment is not None:
        kept.append(f"{attainment:.1%} of requests met every bound in the last minute")
    if broken:
        return SLOCheck("True", "SLOBreached", "; ".join(broken + kept), ttft_ms, tpot_ms, requests)
    if attainment is not None and attainment < AT_RISK_ATTAINMENT:
        return SLOCheck(
            "True", "AttainmentLow",
            f"{'; '.join(kept)}, below {AT_RISK_ATTAINMENT:.0%}", ttft_ms, tpot_ms, requests,
        )  # fmt: skip
    return SLOCheck(
        "False", "WithinSLO", "; ".join(kept) or "no latency observed", ttft_ms, tpot_ms, requests
    )
