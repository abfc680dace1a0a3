"""spec.kvCache: the shared Valkey server's objects, the replicas' and the router's flags."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.engine import engine_container
from plimsoll.operator.resources.kv_cache import kv_children
from plimsoll.operator.resources.router import build_router_deployment
from plimsoll.operator.resources.settings import BuildSettings


def service(spec: dict[str, Any]) -> LLMService:
    return LLMService.model_validate({
        "apiVersion": "plimsoll.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": {"model": {"uri": "embedded://smollm2-135m"}, **spec},
    })  # fmt: skip


def test_shared_tier_deploys_valkey_and_points_replicas_at_it() -> None:
    svc = service({"kvCache": {"offload": {"size": "4Gi"}, "shared": {"size": "2Gi"}},
                   "router": {"enabled": True, "policy": "precise-prefix"}})  # fmt: skip
    deployment, service_obj = kv_children(svc)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory") + 1] == str(2 * 2**30) and "allkeys-lru" in args
    assert service_obj["metadata"]["name"] == deployment["metadata"]["name"] == "chat-kv"
    container, _ = engine_container(svc, BuildSettings())
    engine_args = container["args"]
    assert engine_args[engine_args.index("--kv-offloading-size") + 1] == "4"
    assert engine_args[engine_args.index("--kv-shared-url") + 1] == "redis://chat-kv.ns.svc:6379/0"
    events = json.loads(engine_args[engine_args.index("--kv-events-config") + 1])
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
    router_args = build_router_deployment(svc, BuildSettings())["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert router_args[router_args.index("--kv-tokenizer") + 1] == "smollm2-135m"
    assert router_args[router_args.index("--policy") + 1] == "precise-prefix"


def test_existing_endpoint_deploys_nothing() -> None:
    svc = service({"kvCache": {"shared": {"endpoint": "redis://cache.infra:6379/2"}}})
    assert kv_children(svc) == []
    args = engine_container(svc, BuildSettings())[0]["args"]
    assert args[args.index("--kv-shared-url") + 1] == "redis://cache.infra:6379/2"
    assert "--kv-events-config" not in args


def test_precise_prefix_needs_a_tokenizer_the_router_can_read() -> None:
    with pytest.raises(ValidationError, match="tokenizer in the router pod"):
        LLMService.model_validate({
            "apiVersion": "plimsoll.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": "x"},
            "spec": {"model": {"uri": "hf://org/model"}, "router": {"policy": "precise-prefix"}},
        })  # fmt: skip
