"""spec.engine.schedulingPolicy and spec.observability.tracing reach the replicas' and router's args."""

from typing import Any

import pytest

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.router import build_router_deployment
from plimsoll.operator.resources.settings import BuildSettings

ENDPOINT = "http://otel-collector.observability:4318/v1/traces"


def svc(engine: dict[str, Any]) -> LLMService:
    return LLMService.from_body({
        "metadata": {"name": "chat", "namespace": "team-a"},
        "spec": {
            "model": {"uri": "hf://Qwen/Qwen3-0.6B"},
            "engine": engine,
            "router": {"enabled": True},
            "observability": {"tracing": {"otlpEndpoint": ENDPOINT}},
        },
    })


def args_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize(("kind", "policy", "rendered"), [
    ("plimsoll", "priority", "priority"), ("vllm", "priority", "priority"), ("vllm", "continuous", "fcfs"),
])
def test_policy_and_tracing_rendered(kind: str, policy: str, rendered: str) -> None:
    s = svc({"kind": kind, "schedulingPolicy": policy})
    settings = BuildSettings()
    replica_args = build_deployment(s, settings)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args_after(replica_args, "--scheduling-policy") == rendered
    assert args_after(replica_args, "--otlp-traces-endpoint") == ENDPOINT
    router_args = build_router_deployment(s, settings)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args_after(router_args, "--otlp-traces-endpoint") == ENDPOINT


def test_static_is_refused_for_vllm_and_endpoint_must_be_a_url() -> None:
    with pytest.raises(ValueError, match="static exists only in plimsoll"):
        svc({"kind": "vllm", "schedulingPolicy": "static"})
    with pytest.raises(ValueError, match=r"otlpEndpoint|otlp_endpoint"):
        LLMService.from_body({"metadata": {"name": "x"}, "spec": {
            "model": {"uri": "hf://a/b"}, "observability": {"tracing": {"otlpEndpoint": "collector:4318"}}}})
