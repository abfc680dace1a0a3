"""The Service in front of the replicas, and the endpoint URL clients use. Pure."""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.labels import common_labels, selector_labels
from plimsoll.operator.resources.settings import ENGINE_PORT


def build_service(svc: LLMService) -> dict[str, Any]:
    """A ClusterIP Service on the engine's HTTP port."""
    return cluster_ip_service(svc, svc.name, "replica", "http", ENGINE_PORT, "http")


def cluster_ip_service(
    svc: LLMService, name: str, component: str, port_name: str, port: int, target_port: int | str
) -> dict[str, Any]:
    """A ClusterIP Service ``name`` on one TCP port, selecting ``svc``'s pods of ``component``."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": svc.namespace, "labels": common_labels(svc, component)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(svc, component),
            "ports": [{"name": port_name, "port": port, "targetPort": target_port, "protocol": "TCP"}],
        },
    }


def endpoint_url(svc: LLMService) -> str:
    """The OpenAI base URL inside the cluster."""
    return f"http://{svc.name}.{svc.namespace}.svc:{ENGINE_PORT}/v1"
