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
