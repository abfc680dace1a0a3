"""The replicas' NetworkPolicy and the credentials every pod gets from Secrets: golden files and rules.

Regenerate the golden files after an intended change with ``PLIMSOLL_UPDATE_GOLDEN=1`` and review the diff.
"""

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.credentials import admin_secret_name, build_admin_secret
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.leader_worker_set import build_leader_worker_set
from plimsoll.operator.resources.network_policy import build_network_policy, network_policies
from plimsoll.operator.resources.profile_job import build_profile_job
from plimsoll.operator.resources.router import build_router_deployment
from plimsoll.operator.resources.settings import BuildSettings

GOLDEN = Path(__file__).parent / "golden"
OPERATOR = BuildSettings(
    plimsoll_image="plimsoll:test",
    operator_namespace="plimsoll-system",
    operator_pod_labels={"app.kubernetes.io/name": "plimsoll", "app.kubernetes.io/component": "operator"},
)
SECRET = {"name": "chat-api-key", "key": "api-key"}


def service(**spec: Any) -> LLMService:
    body = {
        "apiVersion": "plimsoll.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "0000-1111"},
        "spec": {"model": {"uri": "embedded://smollm2-135m"}, **spec},
    }
    return LLMService.from_body(body)


CASES = {
    # No router: the Service is the endpoint, so the namespace's pods are the clients.
    "network-policy-no-router": service(),
    # Router in front, an extra peer (a Gateway in another namespace).
    "network-policy-router": service(
        router={"enabled": True},
        networkPolicy={
            "ingressFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}]
        },
    ),
    # KV events to the router (precise-prefix) and a shared Valkey the operator runs: their own rules.
    "network-policy-kv": service(router={"enabled": True, "policy": "precise-prefix"}, kvCache={"shared": {}}),
    # Two nodes per replica (vLLM on Ray): a second rule, every port, only between this service's pods.
    "network-policy-multi-node": service(
        model={"uri": "hf://org/model"}, engine={"kind": "vllm"}, resources={"nodes": 2, "gpu": {"count": 8}}
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_network_policy_matches_golden(name: str) -> None:
    text = yaml.safe_dump_all(network_policies(CASES[name], OPERATOR), sort_keys=True, width=120)
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("PLIMSOLL_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"{path} missing; run with PLIMSOLL_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), (
        f"{name}: the NetworkPolicy changed; review, then PLIMSOLL_UPDATE_GOLDEN=1"
    )


def test_the_policy_selects_the_replicas_and_lets_in_only_the_named_peers() -> None:
    svc = CASES["network-policy-router"]
    policy = build_network_policy(svc, OPERATOR)["spec"]
    deployment = build_deployment(svc, OPERATOR)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = policy["podSelector"]
    assert selector["matchLabels"].items() <= labels.items()
    assert labels["app.kubernetes.io/component"] in selector["matchExpressions"][0]["values"]
    assert policy["policyTypes"] == ["Ingress"] and len(policy["ingress"]) == 1
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    components = {p["podSelector"]["matchLabels"].get("app.kubernetes.io/component") for p in rule["from"]
                  if "namespaceSelector" not in p}  # fmt: skip
    assert components == {"router", "profile"}  # not "any pod of the namespace": a router is in front
    assert {"podSelector": {}} not in rule["from"]
    operator = next(p for p in rule["from"] if p.get("namespaceSelector", {}).get("matchLabels"))
    assert operator["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "plimsoll-system"}
    # Ray ports for multi-node groups only, and only from the same LLMService's pods.
    ray = build_network_policy(CASES["network-policy-multi-node"], OPERATOR)["spec"]["ingress"][1]
    assert "ports" not in ray and ray["from"] == [
        {"podSelector": selector | {"matchLabels": {"plimsoll.dev/llmservice": "chat"}}}
    ]


def test_keys_reach_every_pod_from_secrets_never_as_literals() -> None:
    svc = service(
        router={"enabled": True, "tenantKeysSecretRef": {"name": "tenants"}},
        engine={"apiKeySecretRef": SECRET},
    )
    engine = build_deployment(svc, OPERATOR)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in engine["env"]}
    assert env["PLIMSOLL_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": admin_secret_name(svc),
        "key": "admin-api-key",
    }
    assert env["PLIMSOLL_API_KEY"]["valueFrom"]["secretKeyRef"] == SECRET
    assert not [a for a in engine["args"] if "key" in a.lower()], engine["args"]
    assert engine["securityContext"]["readOnlyRootFilesystem"] is True
    router = build_router_deployment(svc, OPERATOR)
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "PLIMSOLL_API_KEY", "valueFrom": {"secretKeyRef": SECRET}} in container["env"]
    assert container["args"][-2:] == ["--tenant-keys-dir", "/etc/plimsoll/tenant-keys"]
    volume = next(v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == "tenant-keys")
    assert volume["secret"]["secretName"] == "tenants"
    job = build_profile_job(svc, "10.0.0.5", OPERATOR, "abc")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "PLIMSOLL_API_KEY", "valueFrom": {"secretKeyRef": SECRET}} in job["env"]
    assert "--api-key" not in job["args"]
    vllm = service(model={"uri": "hf://org/m"}, engine={"kind": "vllm", "apiKeySecretRef": SECRET})
    vllm_env = build_deployment(vllm, OPERATOR)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": SECRET}} in vllm_env
    assert not [e for e in vllm_env if e["name"] == "PLIMSOLL_ADMIN_API_KEY"]


def test_multi_node_ray_runs_with_token_authentication() -> None:
    lws = build_leader_worker_set(CASES["network-policy-multi-node"], OPERATOR)["spec"][
        "leaderWorkerTemplate"
    ]
    for template in (lws["leaderTemplate"], lws["workerTemplate"]):
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "chat-admin-key",
            "key": "ray-auth-token",
        }


def test_the_credentials_secret_holds_what_the_pods_read() -> None:
    values = {"admin-api-key": "k-7f3a9", "ray-auth-token": "r-0c5e2", "kv-password": "p-1d4b8",
              "wake-api-key": "w-2e6c1"}  # fmt: skip
    secret = build_admin_secret(service(), values)
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "chat-admin-key"
    assert set(secret["data"]) == set(values)
    assert "k-7f3a9" not in json.dumps(secret)  # base64, as the API stores it


def test_plimsoll_replicas_get_bounded_admission_and_lora_roots_by_default() -> None:
    args = build_deployment(service(), OPERATOR)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (
        args[args.index("--max-waiting") + 1] == "512" and args[args.index("--request-timeout") + 1] == "600"
    )
    own = service(engine={"args": ["--max-waiting", "9"]})
    args = build_deployment(own, OPERATOR)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args.count("--max-waiting") == 1 and args[-1] == "9"
    lora = service(adapters=[{"name": "sql", "uri": "pvc://loras/sql"}])
    args = build_deployment(lora, OPERATOR)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--allow-runtime-lora-updating" in args
    roots = [args[i + 1] for i, a in enumerate(args) if a == "--lora-allowed-roots"]
    assert roots == ["/mnt/adapters", "/mnt/models", "/var/cache/plimsoll/models"]


def test_the_router_reaches_kv_events_and_only_the_replicas_reach_the_shared_tier() -> None:
    svc = CASES["network-policy-kv"]
    replicas, valkey = network_policies(svc, OPERATOR)
    events = replicas["spec"]["ingress"][1]
    assert events["ports"] == [{"protocol": "TCP", "port": 5557}]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in events["from"]] == ["router"]
    assert valkey["metadata"]["name"] == "chat-kv"
    assert valkey["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "kv-cache"
    (rule,) = valkey["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    assert rule["from"] == [{"podSelector": replicas["spec"]["podSelector"]}]
    assert network_policies(service(networkPolicy={"enabled": False}), OPERATOR) == []


def test_a_split_services_prefill_pool_is_covered_and_its_kv_port_open_to_the_decode_pool_only() -> None:
    from plimsoll.operator.resources.pools import build_prefill_deployment

    svc = service(router={"enabled": True}, disaggregation={"kvPort": 15000})
    policy = build_network_policy(svc, OPERATOR)["spec"]
    prefill = build_prefill_deployment(svc, OPERATOR)["spec"]["template"]["metadata"]["labels"]
    decode = build_deployment(svc, OPERATOR)["spec"]["template"]["metadata"]["labels"]
    selector = policy["podSelector"]
    for labels in (prefill, decode):
        assert selector["matchLabels"].items() <= labels.items()
        assert labels["app.kubernetes.io/component"] in selector["matchExpressions"][0]["values"]
    kv = next(r for r in policy["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 15000}])
    (peer,) = kv["from"]
    assert peer["podSelector"]["matchLabels"].items() <= decode.items()
    assert not peer["podSelector"]["matchLabels"].items() <= prefill.items()
