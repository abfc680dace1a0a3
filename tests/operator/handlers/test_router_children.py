"""Which router objects reconcile applies (all six when enabled, RBAC before the pod; none when off),
and that the chart lets the operator create them."""

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from plimsoll.devcluster import paths
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.kube import PLURALS
from plimsoll.operator.handlers.router_children import router_children, router_objects
from plimsoll.operator.resources.settings import BuildSettings

SETTINGS = BuildSettings(plimsoll_image="plimsoll:test")
CHART = Path(__file__).resolve().parents[3] / "charts" / "plimsoll"
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
    assert [o["kind"] for o in objects] == [
        "ServiceAccount", "Role", "RoleBinding", "Deployment", "PodDisruptionBudget", "Service"
    ]  # fmt: skip
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


def _granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


@pytest.mark.parametrize("sets", [[], ["rbac.scope=namespaced", "watchNamespaces={prod}"]])
def test_chart_rbac_lets_the_operator_create_the_router_and_grant_its_role(sets: list[str]) -> None:
    """Kubernetes refuses a Role that grants more than its creator holds (escalation check)."""
    args = ["template", "plimsoll", str(CHART), "--namespace", "plimsoll-system"]
    for s in sets:
        args += ["--set", s]
    binary = paths.binary("helm")
    assert binary.exists(), f"{binary} missing; build it with `bash devcluster/build.sh`"
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120, check=True)
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    held = _granted(next(d for d in docs if d["kind"] in ("ClusterRole", "Role"))["rules"])
    objects = router_objects(_svc(True), SETTINGS)
    for obj in objects:
        group = obj["apiVersion"].rpartition("/")[0]
        plural = PLURALS[(obj["apiVersion"], obj["kind"])]
        missing = {(group, plural, v) for v in ("get", "create", "patch", "delete")} - held
        assert not missing, (
            f"the chart's operator RBAC lacks {sorted(missing)} for the router's {obj['kind']}"
        )
    router_role = next(o for o in objects if o["kind"] == "Role")
    assert _granted(router_role["rules"]) <= held, "the router's Role grants what the operator does not hold"
