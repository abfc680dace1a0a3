"""PrometheusRule and scrape builders: thresholds follow the profile, every expression parses."""

from typing import Any

import promql_parser
import pytest

from plimsoll.metric_names import PLIMSOLL, VLLM
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import CapacityStatus
from plimsoll.operator.resources.monitoring import (
    ALERT_ERRORS,
    ALERT_IN_FLIGHT,
    ALERT_KV,
    ALERT_TPOT,
    ALERT_TTFT,
    OMITTED_ANNOTATION,
    SERIES_LABEL,
    build_pod_monitor,
    build_prometheus_rule,
    build_service_monitor,
    in_flight_basis,
)


def service(
    capacity: dict[str, Any] | None = None, slo: dict[str, Any] | None = None, **spec: Any
) -> LLMService:
    body = {
        "metadata": {"name": "chat", "namespace": "team-a"},
        "spec": {
            "model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct"},
            "capacity": capacity or {"mode": "Profile"},
            "slo": slo or {},
            **spec,
        },
    }
    return LLMService.from_body(body)


def alerts(rule: dict[str, Any]) -> dict[str, dict[str, Any]]:
    [group] = rule["spec"]["groups"]
    return {r["alert"]: r for r in group["rules"]}


def threshold(expr: str) -> float:
    """The right-hand number of the top-level `> N` comparison, read from the parsed AST."""
    ast = promql_parser.parse(expr)
    assert isinstance(ast, promql_parser.BinaryExpr), expr
    assert isinstance(ast.rhs, promql_parser.NumberLiteral), expr
    return float(ast.rhs.val)


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    found: list[promql_parser.VectorSelector] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


MEASURED = {
    "knees": {"throughput": {"concurrency": 24}, "latency": {"concurrency": 15}},
    "concurrencyPerReplica": 11,
    "specHash": "abc",
}


def test_manual_capacity_threshold_is_80_percent_of_concurrency_per_replica() -> None:
    svc = service({"mode": "Manual", "concurrencyPerReplica": 12})
    rule = alerts(build_prometheus_rule(svc, None))[ALERT_IN_FLIGHT]
    assert threshold(rule["expr"]) == pytest.approx(0.8 * 12)
    assert rule["for"] == "5m"
    assert "9.6" in rule["annotations"]["summary"]
    assert "team-a/chat" in rule["annotations"]["description"]
    assert "concurrencyPerReplica (12)" in rule["annotations"]["description"]


def test_profiled_threshold_follows_the_lowest_knee_and_moves_with_the_profile() -> None:
    svc = service()
    first = alerts(build_prometheus_rule(svc, MEASURED))[ALERT_IN_FLIGHT]
    assert threshold(first["expr"]) == pytest.approx(0.8 * 15)
    assert "latency knee (15" in first["annotations"]["description"]
    remeasured = {**MEASURED, "knees": {"throughput": {"concurrency": 40}, "latency": {"concurrency": None}}}
    second = alerts(build_prometheus_rule(svc, remeasured))[ALERT_IN_FLIGHT]
    assert threshold(second["expr"]) == pytest.approx(0.8 * 40)


def test_profile_without_knees_falls_back_to_the_recommendation() -> None:
    basis = in_flight_basis(service(), CapacityStatus.model_validate({"concurrencyPerReplica": 7}))
    assert basis is not None and basis.threshold == pytest.approx(5.6)


def test_no_in_flight_alert_without_capacity_and_the_rule_says_why() -> None:
    for capacity in (None, {}, {"knees": {"throughput": {"concurrency": None}}}, {"knees": "garbage"}):
        rule = build_prometheus_rule(service(), capacity)
        assert ALERT_IN_FLIGHT not in alerts(rule), capacity
        assert "no capacity yet" in rule["metadata"]["annotations"][OMITTED_ANNOTATION]
    # KV and error alerts need no profile.
    assert {ALERT_KV, ALERT_ERRORS} <= set(alerts(build_prometheus_rule(service(), None)))


def test_slo_alerts_only_for_objectives_the_spec_sets() -> None:
    without = build_prometheus_rule(service(slo={"preset": "none"}), MEASURED)
    assert not {ALERT_TTFT, ALERT_TPOT} & set(alerts(without))
    assert "spec.slo sets no TTFT p95 objective" in without["metadata"]["annotations"][OMITTED_ANNOTATION]
    rule = alerts(build_prometheus_rule(service(slo={"ttftP95Ms": 800, "tpotP50Ms": 45}), MEASURED))
    assert threshold(rule[ALERT_TTFT]["expr"]) == pytest.approx(0.8)
    assert threshold(rule[ALERT_TPOT]["expr"]) == pytest.approx(0.045)
    assert "histogram_quantile(0.95," in rule[ALERT_TTFT]["expr"]
    assert "800 ms" in rule[ALERT_TTFT]["annotations"]["summary"]
    full = build_prometheus_rule(
        service({"mode": "Manual", "concurrencyPerReplica": 4}, {"ttftP95Ms": 1, "tpotP50Ms": 1}), None
    )
    assert "annotations" not in full["metadata"], "nothing omitted, nothing to explain"
    # No objective set: the interactive preset's TTFT p95 of 3 s is alerted on, TPOT is not.
    preset = alerts(build_prometheus_rule(service(), MEASURED))
    assert threshold(preset[ALERT_TTFT]["expr"]) == pytest.approx(3.0) and ALERT_TPOT not in preset


def test_kv_and_error_thresholds() -> None:
    rule = alerts(build_prometheus_rule(service(), None))
    assert threshold(rule[ALERT_KV]["expr"]) == pytest.approx(0.9)
    assert threshold(rule[ALERT_ERRORS]["expr"]) == pytest.approx(0.05)
    failed = [s for s in selectors(rule[ALERT_ERRORS]["expr"]) if s.name == PLIMSOLL.request_success]
    matchers = {(m.name, m.value) for s in failed for m in s.matchers.matchers}
    assert ("finished_reason", "abort|error") in matchers


@pytest.mark.parametrize(("engine", "family"), [("plimsoll", PLIMSOLL), ("vllm", VLLM)])
def test_every_expression_parses_and_uses_the_engines_own_series(engine: str, family: Any) -> None:
    svc = service(
        {"mode": "Manual", "concurrencyPerReplica": 8},
        {"ttftP95Ms": 500, "tpotP50Ms": 50},
        engine={"kind": engine},
    )
    rule = alerts(build_prometheus_rule(svc, None))
    assert set(rule) == {ALERT_IN_FLIGHT, ALERT_TTFT, ALERT_TPOT, ALERT_KV, ALERT_ERRORS}
    prefix = "plimsoll_" if engine == "plimsoll" else "vllm:"
    for name, alert in rule.items():
        found = selectors(alert["expr"])  # raises on a PromQL syntax error
        assert found, name
        for sel in found:
            assert sel.name is not None and sel.name.startswith(prefix), sel.name
            labels = {m.name: m.value for m in sel.matchers.matchers}
            assert labels["namespace"] == "team-a" and labels[SERIES_LABEL] == "chat", (name, sel)
        assert alert["labels"] == {"severity": "warning", SERIES_LABEL: "chat", "namespace": "team-a"}
        assert {"summary", "description"} <= set(alert["annotations"])
    assert family.ttft + "_bucket" in rule[ALERT_TTFT]["expr"]
    assert family.kv_usage in rule[ALERT_KV]["expr"]


def test_rule_object_shape() -> None:
    rule = build_prometheus_rule(service(), MEASURED)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["metadata"]["name"] == "chat" and rule["metadata"]["namespace"] == "team-a"
    assert rule["metadata"]["labels"]["plimsoll.dev/llmservice"] == "chat"


def test_scrape_objects_carry_the_llmservice_into_a_series_label() -> None:
    svc = service()
    endpoints = [
        build_pod_monitor(svc)["spec"]["podMetricsEndpoints"][0],
        build_service_monitor(svc)["spec"]["endpoints"][0],
    ]
    for endpoint in endpoints:
        [relabel] = endpoint["relabelings"]
        assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_label_plimsoll_dev_llmservice"]
        assert relabel["targetLabel"] == SERIES_LABEL


def test_the_handlers_know_where_each_monitoring_object_lives() -> None:
    from plimsoll.operator.handlers.kube import object_path

    svc = service()
    for obj in (build_pod_monitor(svc), build_service_monitor(svc), build_prometheus_rule(svc, None)):
        plural = obj["kind"].lower() + "s"
        path = object_path(obj["apiVersion"], obj["kind"], "team-a", "chat")
        assert path == f"/apis/monitoring.coreos.com/v1/namespaces/team-a/{plural}/chat"
