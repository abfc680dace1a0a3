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

With KV events on (``router.policy: precise-prefix``) the router may also reach the
replicas' events port. A split service's prefill pool is selected too, and its ``kvPort`` is open
to the decode pool (the replicas) only. For ``resources.nodes`` > 1 a rule opens every port, but only
between this LLMService's own pods (Ray's head, object manager and workers pick their
ports). The shared KV tier's Valkey, when the operator runs it, gets a policy of its own
(``<name>-kv``): only this LLMService's replicas may connect to it.
Everything else is refused by the network plugin (where it enforces NetworkPolicy).

What it is not: egress control, or a policy for the router (its clients are the
service's users; it authenticates them itself).
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.kv_cache import COMPONENT as KV_COMPONENT
from plimsoll.operator.resources.kv_cache import (
    KV_EVENTS_PORT,
    VALKEY_PORT,
    kv_children,
    kv_events_enabled,
    kv_server_name,
)
from plimsoll.operator.resources.labels import LLMSERVICE_LABEL, common_labels, selector_labels
from plimsoll.operator.resources.leader_worker_set import WORKER_COMPONENT
from plimsoll.operator.resources.pools import PREFILL_COMPONENT
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
            # A split service's prefill pool serves too (spec.disaggregation).
            {
                "key": "app.kubernetes.io/component",
                "operator": "In",
                "values": ["replica", WORKER_COMPONENT, PREFILL_COMPONENT],
            },
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
    if kv_events_enabled(svc):
        # The router subscribes to each replica's KV events (ZMQ, published on the replica).
        router = {"podSelector": {"matchLabels": selector_labels(svc, ROUTER_COMPONENT)}}
        ingress.append({"ports": [{"protocol": "TCP", "port": KV_EVENTS_PORT}], "from": [router]})
    if svc.spec.resources.nodes > 1:
        ingress.append({"from": [{"podSelector": _group_selector(svc)}]})
    if svc.spec.disaggregation is not None:
        # Prompts' KV blocks leave a prefill replica on kvPort for the decode pool (the replicas) alone.
        decode = {"podSelector": {"matchLabels": selector_labels(svc)}}
        port = svc.spec.disaggregation.kv_port
        ingress.append({"ports": [{"protocol": "TCP", "port": port}], "from": [decode]})
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


def build_kv_server_network_policy(svc: LLMService) -> dict[str, Any]:
    """The NetworkPolicy of the shared KV tier's Valkey (``spec.kvCache.shared`` deployed by the operator):
    only this LLMService's replicas may connect, so no other pod can read or poison cached blocks."""
    return {
        "apiVersion": NETWORK_POLICY_API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": {
            "name": kv_server_name(svc),
            "namespace": svc.namespace,
            "labels": common_labels(svc, "network-policy"),
        },
        "spec": {
            "podSelector": {"matchLabels": selector_labels(svc, KV_COMPONENT)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "ports": [{"protocol": "TCP", "port": VALKEY_PORT}],
                    "from": [{"podSelector": _group_selector(svc)}],
                }
            ],
        },
    }


def network_policies(svc: LLMService, settings: BuildSettings) -> list[dict[str, Any]]:
    """Every NetworkPolicy the LLMService needs: its replicas', and its Valkey's when the operator runs one."""
    if not uses_network_policy(svc):
        return []
    policies = [build_network_policy(svc, settings)]
    if kv_children(svc):
        policies.append(build_kv_server_network_policy(svc))
    return policies
