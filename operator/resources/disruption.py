"""The replicas' PodDisruptionBudget. Pure."""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.labels import common_labels, selector_labels


def build_pdb(svc: LLMService) -> dict[str, Any]:
    """Allow one replica at a time to be evicted.

    maxUnavailable rather than minAvailable: with a single replica, minAvailable 1
    would block every node drain forever, while maxUnavailable 1 lets the drain
    proceed one replica at a time.
    """
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": svc.name, "namespace": svc.namespace, "labels": common_labels(svc)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(svc)}},
    }
