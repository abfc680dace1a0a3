"""The replicas' NetworkPolicy: who may open a connection to an LLMService's serving pods. Pure.

What it is: :func:`build_network_policy`, one ``networking.k8s.io/v1`` NetworkPolicy per
LLMService (``spec.networkPolicy.enabled``, on by default) selecting its replica pods
(and, for multi-node replicas, its Ray workers). Ingress to the serving port is open to:

- the LLMService's router pods and its capacity-profile Job pods;
- the operator's pod (its namespace and labels, from the chart), which drains replicas,
  sets their SLO and loads adapters;
- the metrics scrapers (``BuildSettings.metrics_scraper_peers``, Prometheus by default);
- ``spec.networkPolicy.ingressFrom`` — and, when no router is in front and that list is
  empty, the pods of the LLMService's own namespace (the clients of a router-less
  service), since the replicas' Service is then the endpoint.

For ``resources.nodes`` > 1 a second rule opens every port, but only between this
LLMService's own pods (Ray's head, object manager and workers pick their ports).
Everything else is refused by the network plugin (where it enforces NetworkPolicy).

What it is not: egress control, or a policy for the router (its clients are the
service's users; it authenticates them itself).
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.labels import LLMSERVICE_LABEL, common_labels, selector_labels
from plimsoll.operator.resources.leader_worker_set import WORKER_COMPONENT
from plimsoll.operator.resources.profile_job import PROFILE_COMPONENT
from plimsoll.operator.resources.router import COMPONENT as ROUTER_COMPONENT
from plimsoll.operator.resources.settings import ENGINE_PORT, BuildSettings

NETWORK_POLICY_API_VERSION = "networking.k8s.io/v1"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def uses_network_policy(svc: LLMService) -> bool:
    return bool(svc.spec.network_policy.enabled)


def _group_selector(svc: LLMService) -> dict[str, Any]:
    """This LLMService's serving pods and Ray workers."""
    return {
        "matchLabels": {LLMSERVICE_LABEL: svc.name},
        "matchExpressions": [
            {"key": "app.kubernetes.io/component", "operator": "In", "values": ["replica", WORKER_COMPONENT]}
        ],
    }


def serving_peers(svc: LLMService, settings: BuildSettings) -> list[dict[str, Any]]:
    """Every NetworkPolicyPeer allowed on the serving port (see the module docstring)."""
    peers: list[dict[str, Any]] = [
        {"podSelector": {"matchLabels": selector_labels(svc, ROUTER_COMPONENT)}},
        {"podSelector": {"matchLabels": selector_labels(svc, PROFILE_COMPONENT)}},
    ]
    if settings.operator_namespace:
        operator: dict[str, Any] = {
            "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: settings.operator_namespace}}
        }
        if settings.operator_pod_labels:
            operator["podSelector"] = {"matchLabels": dict(settings.operator_pod_labels)}
        peers.append(operator)
    peers.extend(dict(peer) for peer in settings.metrics_scraper_peers)
    extra = [dict(peer) for peer in svc.spec.network_policy.ingress_from]
    if not extra and not svc.spec.router_in_front():
        # No router: the Service is the endpoint, and its clients are (by default) this namespace's pods.
        extra = [{"podSelector": {}}]
    return peers + extra


def build_network_policy(svc: LLMService, settings: BuildSettings) -> dict[str, Any]:
    """The NetworkPolicy ``<name>`` for ``svc``'s replicas."""
    ingress: list[dict[str, Any]] = [
        {"ports": [{"protocol": "TCP", "port": ENGINE_PORT}], "from": serving_peers(svc, settings)}
    ]
    if svc.spec.resources.nodes > 1:
        ingress.append({"from": [{"podSelector": _group_selector(svc)}]})
    return {
        "apiVersion": NETWORK_POLICY_API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": {
            "name": svc.name,
            "namespace": svc.namespace,
            "labels": common_labels(svc, "network-policy"),
        },
        "spec": {"podSelector": _group_selector(svc), "policyTypes": ["Ingress"], "ingress": ingress},
    }
