"""PrometheusRule per LLMService on the local control plane, once the Prometheus Operator's CRD exists.

The CRD installed here is a trimmed copy of the Prometheus Operator's: the same
group, names and structural schema for ``spec.groups[].rules[]`` (rule fields,
``for`` as a duration string), so the API server really validates what the
operator writes. Replicas are simulated (kwok); no engine runs.
"""

from typing import Any

import promql_parser
import pytest
import yaml
from llms_k8s import apply, condition, get_json, llmservice, wait_for

from plimsoll.operator.resources.monitoring import ALERT_IN_FLIGHT, ALERT_KV, ALERT_TTFT, OMITTED_ANNOTATION

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]

CRD_NAME = "prometheusrules.monitoring.coreos.com"
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
RULE_SCHEMA = {
    "type": "object",
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True},
        "for": {"type": "string", "pattern": DURATION},
        "keep_firing_for": {"type": "string", "minLength": 1, "pattern": DURATION},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["expr"],
}
PROMETHEUS_RULE_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": CRD_NAME},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "kind": "PrometheusRule",
            "plural": "prometheusrules",
            "singular": "prometheusrule",
            "listKind": "PrometheusRuleList",
            "categories": ["prometheus-operator"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "required": ["spec"],
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "metadata": {"type": "object"},
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "groups": {
                                        "type": "array",
                                        "x-kubernetes-list-type": "map",
                                        "x-kubernetes-list-map-keys": ["name"],
                                        "items": {
                                            "type": "object",
                                            "required": ["name"],
                                            "properties": {
                                                "name": {"type": "string", "minLength": 1},
                                                "interval": {"type": "string", "pattern": DURATION},
                                                "rules": {"type": "array", "items": RULE_SCHEMA},
                                            },
                                        },
                                    }
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}


def alerts(rule: dict[str, Any]) -> dict[str, dict[str, Any]]:
    [group] = rule["spec"]["groups"]
    return {r["alert"]: r for r in group["rules"]}


def threshold(expr: str) -> float:
    ast = promql_parser.parse(expr)
    assert isinstance(ast, promql_parser.BinaryExpr) and isinstance(ast.rhs, promql_parser.NumberLiteral), (
        expr
    )
    return float(ast.rhs.val)


def _events(cluster: Any, ns: str, name: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")
    return list((items or {}).get("items", []))


def ready(cluster: Any, ns: str, name: str) -> None:
    def check() -> bool:
        c = condition(get_json(cluster, "llms", name, "-n", ns), "Ready")
        return bool(c and c["status"] == "True")

    wait_for(check, 90, f"LLMService {ns}/{name} Ready=True")


def test_prometheus_rule_once_its_crd_exists_with_thresholds_from_the_spec(
    devcluster: Any, llms_namespace: str
) -> None:
    ns, name = llms_namespace, "alerted"
    manifest = llmservice(
        name, capacity={"mode": "Manual", "concurrencyPerReplica": 6}, slo={"ttftP95Ms": 500}
    )
    apply(devcluster, ns, manifest)
    ready(devcluster, ns, name)
    assert devcluster.kubectl("get", "crd", CRD_NAME, check=False).returncode != 0, (
        "another test left the PrometheusRule CRD installed"
    )
    devcluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(PROMETHEUS_RULE_CRD))
    try:
        devcluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
        rule = wait_for(
            lambda: get_json(devcluster, "prometheusrules", name, "-n", ns), 60, "the PrometheusRule"
        )
        assert rule["metadata"]["ownerReferences"][0]["name"] == name
        stored = alerts(rule)
        assert threshold(stored[ALERT_IN_FLIGHT]["expr"]) == pytest.approx(0.8 * 6)
        assert stored[ALERT_IN_FLIGHT]["for"] == "5m"
        assert threshold(stored[ALERT_TTFT]["expr"]) == pytest.approx(0.5)
        assert threshold(stored[ALERT_KV]["expr"]) == pytest.approx(0.9)
        assert f"{ns}/{name}" in stored[ALERT_IN_FLIGHT]["annotations"]["description"]
        assert "TPOT" in rule["metadata"]["annotations"][OMITTED_ANNOTATION], "no TPOT SLO in the spec"

        # A new capacity moves the threshold on the next reconcile.
        manifest["spec"]["capacity"]["concurrencyPerReplica"] = 10

        def moved() -> dict[str, Any] | None:
            now = get_json(devcluster, "prometheusrules", name, "-n", ns)
            expr = alerts(now)[ALERT_IN_FLIGHT]["expr"] if now else ""
            return now if expr and threshold(expr) == pytest.approx(8.0) else None

        apply(devcluster, ns, manifest)
        wait_for(moved, 60, "the in-flight threshold to follow concurrencyPerReplica 10")

        # The API server validates what the operator writes: a bad duration is refused.
        bad = {**rule, "metadata": {"name": "bad", "namespace": ns}}
        bad["spec"] = {
            "groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up", "for": "five minutes"}]}]
        }
        refused = devcluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(bad), check=False)
        assert refused.returncode != 0 and "for" in refused.stderr
    finally:
        devcluster.kubectl("delete", "crd", CRD_NAME, "--wait=false", check=False)

    # Straight after the CRD's deletion the operator's discovery cache may still list it: a new
    # service must reconcile whole anyway (the rule skipped, the cache refreshed), with its Created Event.
    apply(devcluster, ns, llmservice("after-crd", capacity={"mode": "Manual", "concurrencyPerReplica": 6}))
    ready(devcluster, ns, "after-crd")
    wait_for(
        lambda: "Created" in {e.get("reason") for e in _events(devcluster, ns, "after-crd")},
        30,
        "the Created Event of a service reconciled after the CRD went away",
    )
