"""Prometheus Operator scrape objects for the replicas. Pure.

Built only when the cluster has the monitoring.coreos.com CRDs (the handlers check);
the operator's own autoscaler scrapes pods directly and needs neither.
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.labels import common_labels, selector_labels

MONITORING_GROUP_VERSION = "monitoring.coreos.com/v1"


def build_pod_monitor(svc: LLMService, interval: str = "15s") -> dict[str, Any]:
    """A PodMonitor scraping every replica's /metrics (per pod, as the autoscaler sees them)."""
    return {
        "apiVersion": MONITORING_GROUP_VERSION,
        "kind": "PodMonitor",
        "metadata": {"name": svc.name, "namespace": svc.namespace, "labels": common_labels(svc)},
        "spec": {
            "selector": {"matchLabels": selector_labels(svc)},
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": interval}],
        },
    }


def build_service_monitor(svc: LLMService, interval: str = "15s") -> dict[str, Any]:
    """A ServiceMonitor for clusters that only select ServiceMonitors."""
    return {
        "apiVersion": MONITORING_GROUP_VERSION,
        "kind": "ServiceMonitor",
        "metadata": {"name": svc.name, "namespace": svc.namespace, "labels": common_labels(svc)},
        "spec": {
            "selector": {"matchLabels": selector_labels(svc)},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": interval}],
        },
    }
