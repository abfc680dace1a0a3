"""HPA and KEDA ScaledObject builders: aimed at the LLMService scale subresource, on in-flight per pod."""

from pathlib import Path
from typing import Any

import pytest
import yaml

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.external_autoscaler import (
    adapter_rule,
    backlog_adapter_rule,
    build_hpa,
    build_scaled_object,
    in_flight_metric_name,
    in_flight_query,
    target_quantity,
)
from plimsoll.operator.scaling.starting_size import plan_start


def service(engine: str = "plimsoll", **spec: Any) -> LLMService:
    body: dict[str, Any] = {
        "model": {"uri": "hf://Qwen/Qwen2.5-7B-Instruct" if engine == "vllm" else "embedded://smollm2-135m"},
        "engine": {"kind": engine},
        "scaling": {"min": 2, "max": 7},
        "autoscaling": {
            "mode": "hpa",
            "scaleUpStabilizationSeconds": 20,
            "scaleDownStabilizationSeconds": 300,
            "intervalSeconds": 10,
        },
    }
    body.update(spec)
    return LLMService.from_body(
        {
            "apiVersion": "plimsoll.dev/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": "chat", "namespace": "team-a", "uid": "u1", "generation": 1},
            "spec": body,
        }
    )


def test_hpa_targets_the_llmservice_scale_subresource_on_in_flight_per_pod() -> None:
    hpa = build_hpa(service(), 6)
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    assert hpa["metadata"]["name"] == "chat" and hpa["metadata"]["namespace"] == "team-a"
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "plimsoll.dev/v1alpha1",
        "kind": "LLMService",
        "name": "chat",
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 7)
    assert spec["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "plimsoll_requests_in_flight"},
                "target": {"type": "AverageValue", "averageValue": "6"},
            },
        }
    ]
    assert spec["behavior"] == {
        "scaleUp": {"stabilizationWindowSeconds": 20},
        "scaleDown": {"stabilizationWindowSeconds": 300},
    }


def test_hpa_min_is_at_least_one_and_fractional_targets_are_quantities() -> None:
    hpa = build_hpa(service(scaling={"min": 0, "max": 3}), 2.5)
    assert hpa["spec"]["minReplicas"] == 1
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "2500m"
    assert [target_quantity(v) for v in (4, 4.0, 0.75, 12.125)] == ["4", "4", "750m", "12125m"]


def test_vllm_services_scale_on_the_vllm_series() -> None:
    svc = service("vllm")
    assert build_hpa(svc, 8)["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_requests_in_flight"
    rule = adapter_rule("vllm")
    assert rule["seriesQuery"] == '{__name__="vllm:num_requests_running",namespace!="",pod!=""}'
    assert rule["name"]["as"] == in_flight_metric_name("vllm")
    assert "vllm:num_requests_running|vllm:num_requests_waiting" in rule["metricsQuery"]
    assert "vllm:num_requests_running|vllm:num_requests_waiting" in in_flight_query(svc)


def test_adapter_rule_sums_running_and_waiting_per_pod() -> None:
    rule = adapter_rule("plimsoll")
    assert rule["metricsQuery"] == (
        'sum({__name__=~"plimsoll_num_requests_running|plimsoll_num_requests_waiting",<<.LabelMatchers>>})'
        " by (<<.GroupBy>>)"
    )
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}


def test_scaled_object_has_a_prometheus_trigger_with_the_target_as_threshold() -> None:
    svc = service(
        autoscaling={
            "mode": "keda",
            "prometheusAddress": "http://prometheus.monitoring:9090",
            "intervalSeconds": 10,
        }
    )
    obj = build_scaled_object(svc, 6)
    assert (obj["apiVersion"], obj["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    spec = obj["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "plimsoll.dev/v1alpha1",
        "kind": "LLMService",
        "name": "chat",
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["pollingInterval"]) == (2, 7, 10)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"] == {
        "serverAddress": "http://prometheus.monitoring:9090",
        "query": 'sum({__name__=~"plimsoll_num_requests_running|plimsoll_num_requests_waiting",'
        'namespace="team-a",llmservice="chat"})',
        "threshold": "6",
    }
    assert build_scaled_object(svc, 2.5)["spec"]["triggers"][0]["metadata"]["threshold"] == "2.5"
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"] == {"stabilizationWindowSeconds": 600}


def test_bounds_are_required() -> None:
    svc = service()
    svc.spec.scaling = None
    with pytest.raises(ValueError, match=r"needs scaling\.min and scaling\.max"):
        build_hpa(svc, 4)


def test_hpa_example_is_a_valid_llmservice_and_starts_sized() -> None:
    path = Path(__file__).resolve().parents[3] / "examples" / "llmservice-hpa.yaml"
    body = yaml.safe_load(path.read_text())
    body["metadata"]["namespace"] = "default"
    svc = LLMService.from_body(body)
    assert svc.spec.autoscaling.mode == "hpa"
    plan = plan_start(svc.spec, None)
    assert plan is not None and plan.replicas == 3  # ceil(20 / 8), as the example's comment says
    hpa = build_hpa(svc, 8)
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "8"


def test_with_a_ttft_slo_both_also_scale_on_the_replicas_backlog_in_seconds() -> None:
    slo = {"ttftP95Ms": 500}
    hpa = build_hpa(service(slo=slo), 6)
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [
        "plimsoll_requests_in_flight",
        "plimsoll_backlog_seconds",
    ]
    assert hpa["spec"]["metrics"][1]["pods"]["target"] == {"type": "AverageValue", "averageValue": "500m"}
    rule = backlog_adapter_rule()
    assert rule["name"] == {"matches": "^plimsoll_backlog_seconds$", "as": "plimsoll_backlog_seconds"}
    keda = service(slo=slo, autoscaling={"mode": "keda", "prometheusAddress": "http://prometheus:9090"})
    _, backlog = build_scaled_object(keda, 6)["spec"]["triggers"]
    assert (
        backlog["metadata"]["query"] == 'sum(plimsoll_backlog_seconds{namespace="team-a",llmservice="chat"})'
    )
    assert backlog["metadata"]["threshold"] == "0.5" and backlog["metricType"] == "AverageValue"
    # vLLM exports no backlog; tokenAware false turns the signal off; no SLO, nothing to hold it against.
    assert len(build_hpa(service("vllm", slo=slo), 6)["spec"]["metrics"]) == 1
    off = service(slo=slo, autoscaling={"mode": "hpa", "tokenAware": False})
    assert len(build_hpa(off, 6)["spec"]["metrics"]) == 1
    assert len(build_hpa(service(), 6)["spec"]["metrics"]) == 1  # the preset's objective: not the user's
    assert len(build_hpa(service(slo={"preset": "none"}), 6)["spec"]["metrics"]) == 1
