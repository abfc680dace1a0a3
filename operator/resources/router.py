"""The router in front of an LLMService's replicas: Deployment, PodDisruptionBudget, Service, RBAC. Pure.

When ``spec.router.enabled``, the operator applies these next to the replicas'
Deployment: a small CPU-only Deployment of ``spec.router.replicas`` pods (default 2,
on different nodes where it can, at most one evicted at a time) running `plimsoll route --llmservice`,
which watches the LLMService's pods (hence the Role to get the LLMService and
list/watch pods), a ClusterIP Service ``<name>-router`` on the engine port, and
``router_endpoint_url`` for ``status.endpoint``. What it is not: the decision to
deploy it or the applying; the handlers do that.
"""

from typing import Any

from plimsoll.auth import WAKE_API_KEY_ENV
from plimsoll.operator.api.base import GROUP, PLURAL
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.credentials import (
    WAKE_KEY_FIELD,
    admin_secret_name,
    api_key_env,
    from_secret,
    router_wakes,
)
from plimsoll.operator.resources.deployment import RUN_AS_USER
from plimsoll.operator.resources.engine import model_placement
from plimsoll.operator.resources.kv_cache import kv_router_flags
from plimsoll.operator.resources.labels import common_labels, selector_labels
from plimsoll.operator.resources.service import cluster_ip_service
from plimsoll.operator.resources.settings import ENGINE_PORT, BuildSettings

COMPONENT = "router"
# A router pod told to stop (SIGTERM) keeps serving this long with /ready 503 while the endpoints
# update, then gives its open streams this long to finish; the grace period covers both.
SHUTDOWN_DELAY_S = 5
DRAIN_TIMEOUT_S = 120
TENANT_KEYS_MOUNT = "/etc/plimsoll/tenant-keys"


def router_name(svc: LLMService) -> str:
    return f"{svc.name}-router"


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures}


def _verified_concurrency(svc: LLMService) -> int | None:
    """The per-replica in-flight the spec states (override, else Manual capacity); None when only a profile knows."""
    target = svc.spec.autoscaling.target_in_flight_per_replica
    if target is None and svc.spec.capacity.mode == "Manual":
        target = svc.spec.capacity.concurrency_per_replica
    return None if target is None else max(1, int(target))


def _apart(svc: LLMService) -> dict[str, Any]:
    """Router pods preferably on different nodes, so one node's loss leaves another router serving."""
    term = {
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": selector_labels(svc, COMPONENT)},
    }
    preferred = [{"weight": 100, "podAffinityTerm": term}]
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}}


def build_router_deployment(svc: LLMService, settings: BuildSettings) -> dict[str, Any]:
    """The router Deployment: ``spec.router.replicas`` pods of `plimsoll route`, each discovering the
    replicas from the LLMService's pods and draining on SIGTERM before it exits."""
    name = router_name(svc)
    args = [
        "route", "--host", "0.0.0.0", "--port", str(ENGINE_PORT),
        "--llmservice", svc.name, "--namespace", svc.namespace,
        "--backend-port", str(ENGINE_PORT), "--policy", svc.spec.router.policy,
        "--hold-queue", str(svc.spec.router.hold_queue),
        "--migration-limit", str(svc.spec.router.migration_limit),
        "--migration-wait", f"{svc.spec.router.migration_wait_seconds:g}",
        "--shutdown-delay", str(SHUTDOWN_DELAY_S), "--drain-timeout", str(DRAIN_TIMEOUT_S),
    ]  # fmt: skip
    if svc.spec.router.hold_timeout_seconds is not None:
        args += ["--hold-timeout", str(svc.spec.router.hold_timeout_seconds)]
    if svc.spec.disaggregation is not None:
        # Two hops: prefill on the least-loaded prefill replica, decode by load and prefix (router/prefill_decode.py).
        policy = svc.spec.router.policy
        decode_policy = policy if policy in ("prefix-affinity", "precise-prefix") else "prefix-affinity"
        args += ["--disaggregated", "--decode-policy", decode_policy]
    concurrency = _verified_concurrency(svc)
    if concurrency is not None:
        # Held requests reach a fresh replica no faster than it is known to carry.
        args += ["--release-concurrency", str(concurrency)]
    if svc.spec.observability.tracing.otlp_endpoint:
        args += ["--otlp-traces-endpoint", svc.spec.observability.tracing.otlp_endpoint]
    if svc.spec.slo.admission == "Predicted" and svc.spec.slo.ttft_p95_ms is not None:
        # Requests every replica would answer past the objective are refused at once (router/slo_routing.py).
        args += ["--slo-ttft-ms", f"{svc.spec.slo.ttft_p95_ms:g}"]
    standby = svc.spec.autoscaling.standby
    if standby is not None and not standby.router_wake:
        args.append("--no-standby-wake")  # every wake is the operator's
    placement = model_placement(svc)
    # precise-prefix: the replicas' KV events on the pod IPs, and the model's tokenizer (same image; a
    # pvc:// model is mounted read-only as in the replicas).
    args += kv_router_flags(svc, placement.model_arg or "smollm2-135m")
    precise = svc.spec.router.policy == "precise-prefix"
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"}]
    if precise:
        volumes += placement.volumes
        mounts += placement.mounts
    tenants = svc.spec.router.tenant_keys_secret_ref
    if tenants is not None:
        # One file per tenant, named after it, holding its key: read by the router only.
        volumes.append({"name": "tenant-keys", "secret": {"secretName": tenants.name, "defaultMode": 0o440}})
        mounts.append({"name": "tenant-keys", "mountPath": TENANT_KEYS_MOUNT, "readOnly": True})
        args += ["--tenant-keys-dir", TENANT_KEYS_MOUNT]
    container = {
        "name": "router",
        "image": settings.plimsoll_image,
        "command": ["plimsoll"],
        "args": args,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        # With a hold queue (router.holdQueue > 0) the router is Ready at zero replicas: it holds requests
        # while one starts. Without, it is Ready only once a replica is, and an empty router takes no traffic.
        "readinessProbe": _probe("/ready", period=5, failures=3),
        "livenessProbe": _probe("/health", period=10, failures=3),
        # precise-prefix holds a tokenizer and the KV index (~130 bytes per distinct block hash).
        "resources": {"requests": {"cpu": "100m", "memory": "512Mi" if precise else "128Mi"},
                      "limits": {"cpu": "2", "memory": "2Gi" if precise else "512Mi"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
        },
        "volumeMounts": mounts,
    }
    env = api_key_env(svc)  # clients authenticate with it; the router sends it on to the replicas
    if router_wakes(svc):
        # The router wakes a parked replica itself when every awake one is past its target: the key the
        # replicas take on POST /wake_up and nowhere else, from the Secret, never in its arguments.
        env.append(from_secret(WAKE_API_KEY_ENV, admin_secret_name(svc), WAKE_KEY_FIELD))
    if env:
        container["env"] = env
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": svc.namespace, "labels": common_labels(svc, COMPONENT)},
        "spec": {
            "replicas": svc.spec.router.replicas,
            # A rollout starts the new pod before it stops an old one: never fewer routers than asked.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "selector": {"matchLabels": selector_labels(svc, COMPONENT)},
            "template": {
                "metadata": {
                    "labels": common_labels(svc, COMPONENT),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(ENGINE_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "serviceAccountName": name,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": SHUTDOWN_DELAY_S + DRAIN_TIMEOUT_S + 5,
                    "affinity": _apart(svc),
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": RUN_AS_USER,
                        "runAsGroup": RUN_AS_USER,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def build_router_pdb(svc: LLMService) -> dict[str, Any]:
    """At most one router pod evicted at a time: with two or more, a node drain never leaves none."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": router_name(svc), "namespace": svc.namespace, "labels": common_labels(svc, COMPONENT)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(svc, COMPONENT)}},
    }


def build_router_service(svc: LLMService) -> dict[str, Any]:
    """ClusterIP Service ``<name>-router`` on the engine port, selecting the router pods only."""
    return cluster_ip_service(svc, router_name(svc), COMPONENT, "http", ENGINE_PORT, "http")


def build_router_rbac(svc: LLMService) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding: read this LLMService, list and watch pods. Nothing more."""
    name = router_name(svc)
    labels = common_labels(svc, COMPONENT)
    metadata = {"name": name, "namespace": svc.namespace, "labels": labels}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(metadata)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": dict(metadata),
            "rules": [
                {"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": [svc.name], "verbs": ["get"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": dict(metadata),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": svc.namespace}],
        },
    ]


def router_endpoint_url(svc: LLMService) -> str:
    """The OpenAI base URL clients use when the router is enabled (for ``status.endpoint``)."""
    return f"http://{router_name(svc)}.{svc.namespace}.svc:{ENGINE_PORT}/v1"
