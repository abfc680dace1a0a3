"""Which router objects reconcile applies: all five when enabled, RBAC before the pod; none when off."""

import copy
from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.router_children import router_children, router_objects
from plimsoll.operator.resources.settings import BuildSettings

SETTINGS = BuildSettings(plimsoll_image="plimsoll:test")
BODY: dict[str, Any] = {
    "metadata": {"name": "chat", "namespace": "prod"},
    "spec": {"model": {"uri": "embedded://smollm2-135m"}, "replicas": 2, "autoscaling": {"mode": "off"}},
}


def _svc(enabled: bool) -> LLMService:
    body = copy.deepcopy(BODY)
    body["spec"]["router"] = {"enabled": enabled}
    return LLMService.from_body(body)


def test_enabled_router_applies_rbac_then_deployment_then_service() -> None:
    objects = router_children(_svc(True), SETTINGS)
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"]
    assert {o["metadata"]["name"] for o in objects} == {"chat-router"}
    assert {o["metadata"]["namespace"] for o in objects} == {"prod"}
    pod = objects[3]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == objects[0]["metadata"]["name"]


def test_disabled_router_applies_nothing_but_knows_what_to_delete() -> None:
    assert router_children(_svc(False), SETTINGS) == []
    # Deletion walks the same list, so turning the router off removes exactly what on created.
    assert [o["kind"] for o in router_objects(_svc(False), SETTINGS)] == [
        o["kind"] for o in router_objects(_svc(True), SETTINGS)
    ]
