"""The operator's pure router builders agree with `plimsoll route` and with the replicas' objects."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from typer.main import get_command

from plimsoll.cli import app
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.labels import selector_string
from plimsoll.operator.resources.router import (
    build_router_deployment,
    build_router_pdb,
    build_router_rbac,
    build_router_service,
    router_endpoint_url,
)
from plimsoll.operator.resources.settings import BuildSettings
from plimsoll.router.config import Policy

SETTINGS = BuildSettings(plimsoll_image="plimsoll:test")
BODY: dict[str, Any] = {
    "apiVersion": "plimsoll.dev/v1alpha1",
    "kind": "LLMService",
    "metadata": {"name": "chat", "namespace": "prod"},
    "spec": {
        "model": {"uri": "embedded://smollm2-135m"},
        "resources": {"gpu": {"count": 1}},
        "replicas": 2,
        "autoscaling": {"mode": "off"},
        "router": {"enabled": True, "policy": "prefix-affinity"},
    },
}


def service(**router: Any) -> LLMService:
    body = copy.deepcopy(BODY)
    body["spec"]["router"].update(router)
    return LLMService.from_body(body)


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("policy", ["least-in-flight", "prefix-affinity"])
def test_router_args_parse_with_the_real_cli(policy: str) -> None:
    svc = service(policy=policy)
    container = build_router_deployment(svc, SETTINGS)["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["plimsoll"] and container["args"][0] == "route"
    route = get_command(app).commands["route"]  # type: ignore[attr-defined]
    params = route.make_context("route", list(container["args"][1:])).params
    assert params["llmservice"] == "chat" and params["namespace"] == "prod"
    assert params["policy"] is Policy(policy)
    assert params["port"] == container["ports"][0]["containerPort"]


def test_router_selects_its_own_pods_and_discovery_selects_only_replicas() -> None:
    svc = service()
    router_deployment = build_router_deployment(svc, SETTINGS)
    router_pod_labels = router_deployment["spec"]["template"]["metadata"]["labels"]
    replica_pod_labels = build_deployment(svc, SETTINGS)["spec"]["template"]["metadata"]["labels"]
    router_service = build_router_service(svc)
    assert matches(router_service["spec"]["selector"], router_pod_labels)
    assert not matches(router_service["spec"]["selector"], replica_pod_labels)
    assert matches(router_deployment["spec"]["selector"]["matchLabels"], router_pod_labels)
    # What the router's discovery selects (status.selector): replicas, never routers.
    replica_selector = dict(pair.split("=") for pair in selector_string(svc).split(","))
    assert matches(replica_selector, replica_pod_labels)
    assert not matches(replica_selector, router_pod_labels)
    assert router_endpoint_url(svc) == "http://chat-router.prod.svc:8000/v1"


def test_router_rbac_is_least_privilege() -> None:
    account, role, binding = build_router_rbac(service())
    assert account["kind"] == "ServiceAccount" and account["metadata"]["name"] == "chat-router"
    verbs = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}
    assert verbs == {(("plimsoll.dev",), ("llmservices",)): {"get"}, (("",), ("pods",)): {"list", "watch"}}
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "prod"}]
    deployment = build_router_deployment(service(), SETTINGS)
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "chat-router"


def test_routers_are_two_apart_drained_and_migrating_by_default() -> None:
    svc = service()
    deployment = build_router_deployment(svc, SETTINGS)
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    pod = deployment["spec"]["template"]["spec"]
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert matches(term["podAffinityTerm"]["labelSelector"]["matchLabels"], pod_labels)
    route = get_command(app).commands["route"]  # type: ignore[attr-defined]
    params = route.make_context("route", list(pod["containers"][0]["args"][1:])).params
    assert params["migration_limit"] == 3 and params["migration_wait"] == 30.0
    # The grace period covers the delay with /ready 503 and the drain of open streams.
    assert pod["terminationGracePeriodSeconds"] > params["shutdown_delay"] + params["drain_timeout"]
    pdb = build_router_pdb(svc)
    assert pdb["spec"]["maxUnavailable"] == 1 and matches(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    one = build_router_deployment(service(replicas=1, migrationLimit=0, migrationWaitSeconds=7.5), SETTINGS)
    assert one["spec"]["replicas"] == 1
    args = one["spec"]["template"]["spec"]["containers"][0]["args"]
    params = route.make_context("route", list(args[1:])).params
    assert params["migration_limit"] == 0 and params["migration_wait"] == 7.5
