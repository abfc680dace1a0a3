"""A split LLMService's children: the prefill pool's Deployment, the decode pool's (the service's own), the
router's two hops, what each pool's profile measures, and the status that waits for both pools."""

import json
from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import get_condition
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.pool_view import ROLE_LABEL
from plimsoll.operator.resources.pools import build_prefill_deployment, prefill_selector, profile_view
from plimsoll.operator.resources.readiness import build_status
from plimsoll.operator.resources.router import build_router_deployment
from plimsoll.operator.resources.settings import BuildSettings

SETTINGS = BuildSettings(plimsoll_image="plimsoll:test", vllm_image="vllm/vllm-openai:v0.32.0")


def split(**spec: Any) -> LLMService:
    body = {
        "model": {"uri": "embedded://smollm2-135m"},
        "replicas": 2,
        "resources": {"gpu": {"count": 0}, "cpu": 2, "memory": "4Gi"},
        "engine": {"args": ["--max-num-seqs", "8"]},
        "slo": {"ttftP95Ms": 800, "tpotP50Ms": 40},
        "disaggregation": {
            "prefill": {
                "replicas": 1,
                "resources": {"cpu": 4},
                "engineArgs": ["--max-num-batched-tokens", "4096"],
            },
            "decode": {"engineArgs": ["--max-num-seqs", "64"]},
            "kvPort": 15000,
            "transferTimeoutSeconds": 5,
        },
        **spec,
    }
    return LLMService.from_body(
        {"metadata": {"name": "chat", "namespace": "ns", "generation": 1}, "spec": body}
    )


def engine(deployment: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def transfer_config(args: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(args[args.index("--kv-transfer-config") + 1])
    return config


def test_the_prefill_pool_is_its_own_deployment_with_the_producer_role() -> None:
    svc = split()
    prefill = build_prefill_deployment(svc, SETTINGS)
    assert prefill["metadata"]["name"] == "chat-prefill" and prefill["spec"]["replicas"] == 1
    labels = prefill["spec"]["template"]["metadata"]["labels"]
    assert labels[ROLE_LABEL] == "prefill" and labels["app.kubernetes.io/component"] == "prefill"
    assert prefill["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert prefill_selector(svc) == ",".join(
        f"{k}={v}" for k, v in sorted(prefill["spec"]["selector"]["matchLabels"].items())
    )
    container = engine(prefill)
    config = transfer_config(container["args"])
    assert config["kv_role"] == "kv_producer" and config["kv_port"] == 15000
    assert "--max-num-batched-tokens" in container["args"] and "--max-num-seqs" in container["args"]
    assert {"name": "kv", "containerPort": 15000, "protocol": "TCP"} in container["ports"]
    assert str(container["resources"]["limits"]["cpu"]) == "4"  # the pool's own compute


def test_the_decode_pool_is_the_services_deployment_with_the_consumer_role() -> None:
    svc = split()
    decode = build_deployment(svc, SETTINGS)
    assert decode["metadata"]["name"] == "chat" and decode["spec"]["replicas"] == 2
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert labels[ROLE_LABEL] == "decode" and labels["app.kubernetes.io/component"] == "replica"
    args = engine(decode)["args"]
    config = transfer_config(args)
    assert config["kv_role"] == "kv_consumer"
    assert config["kv_connector_extra_config"]["transfer_timeout"] == 5
    assert args[-args[::-1].index("--max-num-seqs")] == "64", (
        "the pool's engine arguments come after the shared ones"
    )
    assert str(engine(decode)["resources"]["limits"]["cpu"]) == "2"


def test_a_service_that_is_not_split_has_no_roles() -> None:
    svc = split(disaggregation=None)
    deployment = build_deployment(svc, SETTINGS)
    assert ROLE_LABEL not in deployment["spec"]["template"]["metadata"]["labels"]
    assert "--kv-transfer-config" not in engine(deployment)["args"]
    assert (
        "--disaggregated"
        not in build_router_deployment(svc, SETTINGS)["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_the_router_runs_the_two_hops_in_front_of_a_split_service() -> None:
    svc = split()
    assert svc.spec.router_in_front()
    args = build_router_deployment(svc, SETTINGS)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--disaggregated" in args and args[args.index("--decode-policy") + 1] == "prefix-affinity"


def test_each_pools_profile_measures_its_own_phase() -> None:
    svc = split()
    prefill, decode = profile_view(svc, "prefill"), profile_view(svc, "decode")
    assert (
        prefill.spec.capacity.profile.workload.input_tokens,
        prefill.spec.capacity.profile.workload.output_tokens,
    ) == (512, 1)
    assert (prefill.spec.slo.ttft_p95_ms, prefill.spec.slo.tpot_p50_ms) == (800, None)
    assert (
        decode.spec.capacity.profile.workload.input_tokens,
        decode.spec.capacity.profile.workload.output_tokens,
    ) == (64, 128)
    assert (decode.spec.slo.ttft_p95_ms, decode.spec.slo.tpot_p50_ms) == (None, 40)
    assert prefill.spec.disaggregation is None and decode.spec.disaggregation is None
    # The floor on each level's time is the service's, for both pools.
    quick = split(capacity={"mode": "Profile", "profile": {"workload": {"minSecondsPerLevel": 0}}})
    floors = {role: profile_view(quick, role).spec.capacity.profile.workload.min_seconds_per_level
              for role in ("prefill", "decode")}  # fmt: skip
    assert floors == {"prefill": 0, "decode": 0}
    assert profile_view(svc, "prefill").spec.capacity.profile.workload.min_seconds_per_level == 180


def _ready(replicas: int) -> dict[str, Any]:
    return {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": replicas,
            "readyReplicas": replicas, "updatedReplicas": replicas}}  # fmt: skip


def _cond(status: dict[str, Any], type_: str) -> tuple[str, str]:
    c = get_condition(status["conditions"], type_)
    assert c is not None
    return c["status"], c["reason"]


def test_ready_waits_for_the_prefill_pool_and_status_names_the_ratio() -> None:
    svc = split()
    router = {"status": {"readyReplicas": 1}}
    waiting = build_status(svc, _ready(2), {}, now="t0", router=router, prefill={"status": {"replicas": 1}})
    assert _cond(waiting, "Ready") == ("False", "PrefillPoolNotReady")
    assert "prefill pool 0/1 ready" in str(waiting["conditions"])
    ready = build_status(svc, _ready(2), waiting, now="t1", router=router, prefill=_ready(1))
    assert _cond(ready, "Ready") == ("True", "AllReplicasReady")
    assert ready["disaggregation"]["ratio"] == "1P:2D" and ready["disaggregation"]["runs"] == "split"
    assert ready["disaggregation"]["prefill"]["readyReplicas"] == 1
    # No longer split: the block is cleared.
    unsplit = build_status(split(disaggregation=None), _ready(2), ready, now="t2", router=router)
    assert "disaggregation" in unsplit and unsplit["disaggregation"] is None
