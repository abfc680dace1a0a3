"""HorizontalPodAutoscaler and KEDA ScaledObject for ``autoscaling.mode: hpa`` / ``keda``. Pure.

What it is: builders for the object an external autoscaler reads, aimed at the
LLMService's own scale subresource (``plimsoll.dev/v1alpha1``, kind
``LLMService``), so the replica count an HPA or KEDA decides lands in
``spec.replicas`` exactly as the built-in loop's would, and reconcile resizes
the Deployment from there. Both scale on the same signal as the built-in loop:
in-flight requests (running + waiting) per replica against the per-replica
target, with ``scaling.min..max`` and the spec's stabilisation windows.

- hpa: an ``autoscaling/v2`` HPA with a ``Pods`` metric, average value = target.
  The metric comes from the custom metrics API, i.e. a Prometheus Adapter with
  the rule :func:`adapter_rule` returns (documented in docs/autoscaling.md).
- keda: a ``keda.sh/v1alpha1`` ScaledObject with a ``prometheus`` trigger whose
  query sums running + waiting over the service's pods and whose threshold is
  the target (KEDA divides the sum by the replica count, an average value).
- With ``slo.ttftP95Ms`` set (not a preset's; ``autoscaling.tokenAware``, a plimsoll engine) both get a
  second metric, the built-in predicted-TTFT rule's signal: the replicas' backlog in
  seconds (``plimsoll_backlog_seconds``) averaged per pod against the SLO. The HPA
  (and KEDA's) takes the larger of the two recommendations, as the built-in loop
  does; its budget is the whole SLO (it cannot subtract the request's own prefill
  and step), so it asks a little less than the built-in rule, and it credits no
  starting replica by its expected Ready.

What it is not: the decision whether these kinds exist in the cluster or the
calls that apply or delete them (``handlers/external_autoscaler.py``).
"""

from typing import Any

from plimsoll.metric_names import BACKLOG_SECONDS, ENGINE_FAMILIES
from plimsoll.operator.api.base import API_VERSION, KIND
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.labels import common_labels

HPA_API_VERSION = "autoscaling/v2"
KEDA_API_VERSION = "keda.sh/v1alpha1"
# The label the operator's PodMonitor puts on every scraped series (see resources/monitoring.py).
SERIES_LABEL = "llmservice"


def in_flight_metric_name(engine: str) -> str:
    """The custom-metrics name the Prometheus Adapter serves for running + waiting, per engine family."""
    return f"{engine}_requests_in_flight"


def target_quantity(value: float) -> str:
    """A Kubernetes quantity for the per-replica target: ``4`` or, for 2.5, ``2500m``."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def _metadata(svc: LLMService) -> dict[str, Any]:
    """The HPA's or ScaledObject's: named after the service, labelled as its autoscaler."""
    return {"name": svc.name, "namespace": svc.namespace, "labels": common_labels(svc, "autoscaler")}


def _target_ref(svc: LLMService) -> dict[str, str]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": svc.name}


def _behavior(svc: LLMService) -> dict[str, Any]:
    auto = svc.spec.autoscaling
    return {
        "scaleUp": {"stabilizationWindowSeconds": auto.scale_up_stabilization_seconds},
        "scaleDown": {"stabilizationWindowSeconds": auto.scale_down_stabilization_seconds},
    }


def _bounds(svc: LLMService) -> tuple[int, int]:
    scaling = svc.spec.scaling
    if scaling is None:
        raise ValueError(f"autoscaling.mode {svc.spec.autoscaling.mode} needs scaling.min and scaling.max")
    return scaling.min, scaling.max


def adapter_rule(engine: str) -> dict[str, Any]:
    """The Prometheus Adapter rule that serves :func:`in_flight_metric_name` per pod."""
    names = ENGINE_FAMILIES[engine]
    matchers = "<<.LabelMatchers>>"
    return {
        "seriesQuery": f'{{__name__="{names.running}",namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{names.running}$", "as": in_flight_metric_name(engine)},
        "metricsQuery": (
            f'sum({{__name__=~"{names.running}|{names.waiting}",{matchers}}}) by (<<.GroupBy>>)'
        ),
    }


def backlog_target_s(svc: LLMService) -> float | None:
    """Seconds of backlog per pod to scale at (the TTFT SLO), or None when the backlog is not a signal here."""
    spec = svc.spec
    if spec.slo.ttft_p95_ms is None or not spec.autoscaling.token_aware or spec.engine.kind != "plimsoll":
        return None  # vLLM and SGLang export no backlog; without an SLO there is nothing to hold it against
    if spec.slo.defaulted_from is not None:
        # Only an objective the user set: the metric needs its adapter rule, and an HPA that cannot read
        # one of its metrics stops scaling down.
        return None
    return float(spec.slo.ttft_p95_ms) / 1000.0


def backlog_adapter_rule() -> dict[str, Any]:
    """The Prometheus Adapter rule that serves ``plimsoll_backlog_seconds`` per pod (the HPA's second metric)."""
    return {
        "seriesQuery": f'{{__name__="{BACKLOG_SECONDS}",namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{BACKLOG_SECONDS}$", "as": BACKLOG_SECONDS},
        "metricsQuery": "max(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
    }


def backlog_query(svc: LLMService) -> str:
    """PromQL: the backlog seconds summed over the service's pods (KEDA divides by the replicas)."""
    return f'sum({BACKLOG_SECONDS}{{namespace="{svc.namespace}",{SERIES_LABEL}="{svc.name}"}})'


def in_flight_query(svc: LLMService) -> str:
    """PromQL: running + waiting summed over the service's pods (the KEDA trigger's query)."""
    names = ENGINE_FAMILIES[svc.spec.engine.kind]
    return (
        f'sum({{__name__=~"{names.running}|{names.waiting}",'
        f'namespace="{svc.namespace}",{SERIES_LABEL}="{svc.name}"}})'
    )


def build_hpa(svc: LLMService, target: float) -> dict[str, Any]:
    """An HPA on in-flight requests per pod, scaling the LLMService itself.

    ``minReplicas`` is at least 1: an HPA may only go to 0 with the alpha
    HPAScaleToZero feature gate (use keda mode to scale to zero).
    """
    low, high = _bounds(svc)
    return {
        "apiVersion": HPA_API_VERSION,
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(svc),
        "spec": {
            "scaleTargetRef": _target_ref(svc),
            "minReplicas": max(1, low),
            "maxReplicas": high,
            "metrics": [_pods_metric(in_flight_metric_name(svc.spec.engine.kind), target)]
            + (
                [_pods_metric(BACKLOG_SECONDS, backlog)]
                if (backlog := backlog_target_s(svc)) is not None
                else []
            ),
            "behavior": _behavior(svc),
        },
    }


def _pods_metric(name: str, average: float) -> dict[str, Any]:
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": target_quantity(average)},
        },
    }


def _prometheus_trigger(address: str, query: str, threshold: float) -> dict[str, Any]:
    return {
        "type": "prometheus",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": address,
            "query": query,
            # KEDA parses the threshold as a plain number, not a quantity.
            "threshold": str(int(threshold)) if float(threshold).is_integer() else str(threshold),
        },
    }


def build_scaled_object(svc: LLMService, target: float) -> dict[str, Any]:
    """A KEDA ScaledObject with a Prometheus trigger on the service's total in-flight requests."""
    low, high = _bounds(svc)
    auto = svc.spec.autoscaling
    assert auto.prometheus_address is not None, "validated by AutoscalingSpec"
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": _metadata(svc),
        "spec": {
            "scaleTargetRef": _target_ref(svc),
            "minReplicaCount": low,
            "maxReplicaCount": high,
            "pollingInterval": auto.interval_seconds,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(svc)}},
            "triggers": [_prometheus_trigger(auto.prometheus_address, in_flight_query(svc), target)]
            + (
                [_prometheus_trigger(auto.prometheus_address, backlog_query(svc), backlog)]
                if (backlog := backlog_target_s(svc)) is not None
                else []
            ),
        },
    }
