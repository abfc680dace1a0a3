"""The Service in front of the replicas, and the endpoint URL clients use. Pure."""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.labels import common_labels, selector_labels
from plimsoll.operator.resources.settings import ENGINE_PORT


def build_service(svc: LLMService) -> dict[str, Any]:
    """A ClusterIP Service on the engine's HTTP port."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": svc.name, "namespace": svc.namespace, "labels": common_labels(svc)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(svc),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def endpoint_url(svc: LLMService) -> str:
    """The OpenAI base URL inside the cluster."""
    return f"http://{svc.name}.{svc.namespace}.svc:{ENGINE_PORT}/v1"
