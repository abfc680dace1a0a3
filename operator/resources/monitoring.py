"""Prometheus Operator objects for an LLMService: scrape config and alert rules. Pure.

What it is: builders for a PodMonitor (or ServiceMonitor) that scrapes every
replica's ``/metrics`` and stamps each series with an ``llmservice`` label (the
chart's Grafana dashboard and the alerts filter on it), and a PrometheusRule
whose thresholds come from the LLMService itself: the measured knee (or the
Manual ``concurrencyPerReplica``), the spec's SLOs, and fixed KV-cache and error
limits. Queries use the engine's own metric family (``plimsoll_*`` or ``vllm:*``).

What it is not: the code that decides whether the cluster has these CRDs (the
handlers check discovery) or a scraper (the built-in autoscaler reads pods
directly and needs none of this). A threshold it cannot ground in a measurement
or the spec is left out, with the reason in the rule's annotations, never guessed.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from plimsoll.metric_names import ADMISSION_REJECTIONS, ENGINE_FAMILIES, EngineMetricNames
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import CapacityStatus
from plimsoll.operator.resources.labels import LLMSERVICE_LABEL, common_labels, selector_labels

MONITORING_GROUP_VERSION = "monitoring.coreos.com/v1"

# The target label every scraped series gets (from the pod's plimsoll.dev/llmservice label).
SERIES_LABEL = "llmservice"
# Prometheus' service discovery exposes pod labels with non-alphanumerics turned into "_".
_POD_LABEL_META = "__meta_kubernetes_pod_label_" + "".join(
    c if c.isalnum() else "_" for c in LLMSERVICE_LABEL
)

# The seeds' rule: alert when daily load reaches 70-80% of the knee, before latency climbs.
KNEE_ALERT_FRACTION = 0.8
KV_USAGE_ALERT_RATIO = 0.9
ERROR_RATE_ALERT_RATIO = 0.05
ALERT_FOR = "5m"
RATE_WINDOW = "5m"
# Alert names, also used as keys of the "omitted" annotation.
ALERT_IN_FLIGHT = "LLMServiceInFlightNearKnee"
ALERT_TTFT = "LLMServiceTTFTAboveSLO"
ALERT_TPOT = "LLMServiceTPOTAboveSLO"
ALERT_KV = "LLMServiceKVCacheNearlyFull"
ALERT_ERRORS = "LLMServiceErrorRateHigh"
OMITTED_ANNOTATION = "plimsoll.dev/omitted-alerts"
# plimsoll's admission rejections that are the server's doing (400 invalid_request is the client's).
_SERVER_REJECTIONS = "queue_full|draining|timeout"


def _relabel_llmservice() -> list[dict[str, Any]]:
    return [{"sourceLabels": [_POD_LABEL_META], "targetLabel": SERIES_LABEL, "action": "replace"}]


def build_pod_monitor(svc: LLMService, interval: str = "15s") -> dict[str, Any]:
    """A PodMonitor scraping every replica's /metrics (per pod, as the autoscaler sees them)."""
    return _monitor(svc, "PodMonitor", "podMetricsEndpoints", interval)


def build_service_monitor(svc: LLMService, interval: str = "15s") -> dict[str, Any]:
    """A ServiceMonitor for clusters that only select ServiceMonitors."""
    return _monitor(svc, "ServiceMonitor", "endpoints", interval)


def _monitor(svc: LLMService, kind: str, endpoints_field: str, interval: str) -> dict[str, Any]:
    """The Prometheus operator's monitor of ``kind``: the replicas' port ``http`` at /metrics."""
    endpoint = {
        "port": "http",
        "path": "/metrics",
        "interval": interval,
        "relabelings": _relabel_llmservice(),
    }
    return {
        "apiVersion": MONITORING_GROUP_VERSION,
        "kind": kind,
        "metadata": {"name": svc.name, "namespace": svc.namespace, "labels": common_labels(svc)},
        "spec": {"selector": {"matchLabels": selector_labels(svc)}, endpoints_field: [endpoint]},
    }


@dataclass(frozen=True, slots=True)
class InFlightBasis:
    """The per-replica concurrency the in-flight alert is a fraction of, and where it came from."""

    concurrency: float
    source: str  # for the alert's description, e.g. "the latency knee (12)"

    @property
    def threshold(self) -> float:
        return KNEE_ALERT_FRACTION * self.concurrency


def in_flight_basis(svc: LLMService, capacity: CapacityStatus | None) -> InFlightBasis | None:
    """Manual concurrencyPerReplica; else the lowest measured knee; else the profile's recommendation; else None.

    The knee is preferred to the recommendation because the recommendation already
    has headroom taken off: 80% of it would page while the autoscaler is on target.
    """
    if svc.spec.capacity.mode == "Manual" and svc.spec.capacity.concurrency_per_replica is not None:
        value = svc.spec.capacity.concurrency_per_replica
        return InFlightBasis(float(value), f"the Manual capacity.concurrencyPerReplica ({value})")
    if capacity is None:
        return None
    knees = []
    for kind, knee in sorted((capacity.knees or {}).items()):
        concurrency = knee.get("concurrency") if isinstance(knee, dict) else None
        if isinstance(concurrency, int | float) and not isinstance(concurrency, bool) and concurrency > 0:
            knees.append((float(concurrency), kind))
    if knees:
        knee_value, kind = min(knees)
        return InFlightBasis(knee_value, f"the measured {kind} knee ({_num(knee_value)} concurrent requests)")
    if capacity.concurrency_per_replica is not None:
        value = capacity.concurrency_per_replica
        return InFlightBasis(float(value), f"the profiled concurrency per replica ({value})")
    return None


def _num(x: float) -> str:
    """A threshold as PromQL and people read it: no float noise (0.8 × 12 = 9.600000000000001)."""
    rounded = round(x, 6)
    return str(int(rounded)) if math.isclose(rounded, int(rounded)) else f"{rounded:g}"


def _selector(svc: LLMService, **regex: str) -> str:
    """``{namespace="ns", llmservice="name"}`` plus a regex matcher per keyword."""
    matchers = [f'namespace="{svc.namespace}"', f'{SERIES_LABEL}="{svc.name}"']
    matchers += [f'{label}=~"{pattern}"' for label, pattern in regex.items()]
    return "{" + ", ".join(matchers) + "}"


def in_flight_expr(svc: LLMService, names: EngineMetricNames) -> str:
    """Mean (running + waiting) per scraped replica, as the built-in autoscaler computes it."""
    sel = _selector(svc)
    return f"(sum({names.running}{sel}) + sum({names.waiting}{sel})) / count({names.running}{sel})"


def quantile_expr(svc: LLMService, histogram: str, q: float) -> str:
    """The q-quantile over all replicas of a latency histogram, over the rate window."""
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{_selector(svc)}[{RATE_WINDOW}])))"


def error_ratio_expr(svc: LLMService, names: EngineMetricNames) -> str:
    """Share of requests that failed on the server's side: finished abort/error, plus (plimsoll) rejections."""
    sel, failed = _selector(svc), _selector(svc, finished_reason="abort|error")
    failures = f"sum(rate({names.request_success}{failed}[{RATE_WINDOW}]))"
    total = f"sum(rate({names.request_success}{sel}[{RATE_WINDOW}]))"
    if names is ENGINE_FAMILIES["plimsoll"]:
        # Requests refused before the engine never reach request_success: add them to both sides.
        rejected = (
            f"sum(rate({ADMISSION_REJECTIONS}{_selector(svc, reason=_SERVER_REJECTIONS)}[{RATE_WINDOW}]))"
        )
        failures, total = f"({failures} + {rejected})", f"({total} + {rejected})"
    return f"{failures} / {total}"


def _alert(svc: LLMService, name: str, expr: str, summary: str, description: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": ALERT_FOR,
        "labels": {"severity": "warning", SERIES_LABEL: svc.name, "namespace": svc.namespace},
        "annotations": {"summary": summary, "description": description},
    }


def build_alerts(
    svc: LLMService, capacity: CapacityStatus | None
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The alerting rules for ``svc`` and, for each alert left out, why."""
    names = ENGINE_FAMILIES[svc.spec.engine.kind]
    who = f"LLMService {svc.namespace}/{svc.name}"
    rules: list[dict[str, Any]] = []
    omitted: dict[str, str] = {}

    basis = in_flight_basis(svc, capacity)
    if basis is None:
        omitted[ALERT_IN_FLIGHT] = (
            "no capacity yet: capacity.mode Profile has no measured knee in status.capacity; "
            "the alert appears once the profiling Job reports one"
        )
    else:
        threshold = _num(basis.threshold)
        rules.append(
            _alert(
                svc,
                ALERT_IN_FLIGHT,
                f"{in_flight_expr(svc, names)} > {threshold}",
                f"{who}: in-flight requests per replica above {threshold}",
                f"{who} carries {{{{ $value | humanize }}}} in-flight requests (running + waiting) per replica, "
                f"above {threshold} = {_num(KNEE_ALERT_FRACTION * 100)}% of {basis.source}, for {ALERT_FOR}. "
                "Latency climbs past the knee: add replicas or raise scaling.max.",
            )
        )

    for alert, histogram, slo_ms, quantile, label in (
        (ALERT_TTFT, names.ttft, svc.spec.slo.ttft_p95_ms, 0.95, "TTFT p95"),
        (ALERT_TPOT, names.tpot, svc.spec.slo.tpot_p50_ms, 0.5, "TPOT p50"),
    ):
        if slo_ms is None:
            omitted[alert] = f"spec.slo sets no {label} objective"
            continue
        seconds = _num(slo_ms / 1000)
        rules.append(
            _alert(
                svc,
                alert,
                f"{quantile_expr(svc, histogram, quantile)} > {seconds}",
                f"{who}: {label} above the SLO of {_num(slo_ms)} ms",
                f"{who} has {label} {{{{ $value | humanizeDuration }}}} over the last {RATE_WINDOW}, "
                f"above the spec.slo objective of {_num(slo_ms)} ms, for {ALERT_FOR}.",
            )
        )

    ratio = _num(KV_USAGE_ALERT_RATIO)
    rules.append(
        _alert(
            svc,
            ALERT_KV,
            f"{names.kv_usage}{_selector(svc)} > {ratio}",
            f"{who}: KV cache above {_num(KV_USAGE_ALERT_RATIO * 100)}% on {{{{ $labels.pod }}}}",
            f"Replica {{{{ $labels.pod }}}} of {who} has {{{{ $value | humanizePercentage }}}} of its KV-cache "
            f"blocks in use, above {_num(KV_USAGE_ALERT_RATIO * 100)}%, for {ALERT_FOR}: new requests wait "
            "for blocks and running ones get preempted. Lower the per-replica concurrency or give the KV "
            "cache more memory.",
        )
    )
    limit = _num(ERROR_RATE_ALERT_RATIO)
    rules.append(
        _alert(
            svc,
            ALERT_ERRORS,
            f"{error_ratio_expr(svc, names)} > {limit}",
            f"{who}: error rate above {_num(ERROR_RATE_ALERT_RATIO * 100)}%",
            f"{{{{ $value | humanizePercentage }}}} of the requests to {who} failed on the server's side "
            f"(finished with abort or error, or refused as queue full, draining or timed out) over the "
            f"last {RATE_WINDOW}, above {_num(ERROR_RATE_ALERT_RATIO * 100)}%, for {ALERT_FOR}.",
        )
    )
    return rules, omitted


def read_capacity(capacity: CapacityStatus | Mapping[str, Any] | None) -> CapacityStatus | None:
    """``status.capacity`` as stored (camelCase dict) or already parsed; None when absent or unreadable."""
    if capacity is None or isinstance(capacity, CapacityStatus):
        return capacity
    try:
        return CapacityStatus.model_validate(dict(capacity))
    except ValidationError:
        # Someone edited status by hand: no threshold is better than a wrong one.
        return None


def build_prometheus_rule(
    svc: LLMService, capacity: CapacityStatus | Mapping[str, Any] | None
) -> dict[str, Any]:
    """A PrometheusRule with the LLMService's alerts; ``capacity`` is its ``status.capacity`` (or None)."""
    rules, omitted = build_alerts(svc, read_capacity(capacity))
    metadata: dict[str, Any] = {"name": svc.name, "namespace": svc.namespace, "labels": common_labels(svc)}
    if omitted:
        metadata["annotations"] = {
            OMITTED_ANNOTATION: "; ".join(f"{alert}: {why}" for alert, why in sorted(omitted.items()))
        }
    return {
        "apiVersion": MONITORING_GROUP_VERSION,
        "kind": "PrometheusRule",
        "metadata": metadata,
        "spec": {"groups": [{"name": f"plimsoll.{svc.namespace}.{svc.name}", "rules": rules}]},
    }
