"""KV tiers of an LLMService: the shared Valkey server's objects and the flags replicas and router get.

What it is: pure builders. ``spec.kvCache.shared`` without an ``endpoint`` deploys a Valkey
Deployment and Service named ``<llmservice>-kv`` (owned by the LLMService, so they go with it;
``maxmemory`` from ``size`` with ``allkeys-lru``, nothing persisted, ``requirepass`` set to a
random password from the ``<name>-admin-key`` Secret); with one, the replicas use it
(``passwordSecretRef`` for its password). ``kv_engine_env`` hands a replica the password from
the Secret, never as an argument. ``kv_engine_flags`` gives each replica ``--kv-offloading-size``, ``--kv-shared-url`` and
``--kv-events-config``; ``kv_router_flags`` points a precise-prefix router at the replicas'
events and at the model's tokenizer. What it is not: applying them (reconcile does).
"""

from __future__ import annotations

import json
from typing import Any

from plimsoll.auth import KV_SHARED_PASSWORD_ENV
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.credentials import KV_PASSWORD_FIELD, admin_secret_name, from_secret
from plimsoll.operator.resources.labels import common_labels, selector_labels
from plimsoll.operator.resources.quantity import to_bytes
from plimsoll.operator.resources.service import cluster_ip_service

COMPONENT = "kv-cache"
VALKEY_PORT = 6379
KV_EVENTS_PORT = 5557
VALKEY_PASSWORD_ENV = "VALKEY_PASSWORD"
VALKEY_AUTH_DIR = "/run/valkey"
# $0 is the server's binary, "$@" the arguments; the file is the first config source, the flags override the rest.
VALKEY_START = (
    f'umask 077 && printf \'requirepass "%s"\\n\' "${VALKEY_PASSWORD_ENV}" > {VALKEY_AUTH_DIR}/auth.conf '
    f'&& exec "$0" {VALKEY_AUTH_DIR}/auth.conf "$@"'
)


def kv_server_name(svc: LLMService) -> str:
    return f"{svc.name}-kv"


def kv_shared_url(svc: LLMService) -> str | None:
    shared = svc.spec.kv_cache.shared
    if shared is None:
        return None
    return shared.endpoint or f"redis://{kv_server_name(svc)}.{svc.namespace}.svc:{VALKEY_PORT}/0"


def kv_events_enabled(svc: LLMService) -> bool:
    events = svc.spec.kv_cache.events
    return events if events is not None else svc.spec.router.policy == "precise-prefix"


def kv_engine_flags(svc: LLMService) -> list[str]:
    kv = svc.spec.kv_cache
    args: list[str] = []
    if kv.offload is not None:
        args += [
            "--kv-offloading-backend",
            "native",
            "--kv-offloading-size",
            f"{to_bytes(kv.offload.size) / 2**30:g}",
        ]
    url = kv_shared_url(svc)
    if url is not None and svc.spec.engine.kind == "plimsoll":
        assert kv.shared is not None
        args += ["--kv-shared-url", url, "--kv-shared-timeout", f"{kv.shared.timeout_seconds:g}"]
    if kv_events_enabled(svc):
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}"}
        args += ["--kv-events-config", json.dumps(config, separators=(",", ":"))]
    return args


def kv_engine_env(svc: LLMService) -> list[dict[str, Any]]:
    """The shared tier's password for a plimsoll replica, from a Secret (never an argument): the
    operator's Valkey's own, or ``passwordSecretRef`` of an existing endpoint; [] without one."""
    shared = svc.spec.kv_cache.shared
    if shared is None or svc.spec.engine.kind != "plimsoll":
        return []
    if shared.endpoint is None:
        return [from_secret(KV_SHARED_PASSWORD_ENV, admin_secret_name(svc), KV_PASSWORD_FIELD)]
    ref = shared.password_secret_ref
    return [] if ref is None else [from_secret(KV_SHARED_PASSWORD_ENV, ref.name, ref.key)]


def kv_router_flags(svc: LLMService, tokenizer: str) -> list[str]:
    if svc.spec.router.policy != "precise-prefix":
        return []
    return ["--kv-events-port", str(KV_EVENTS_PORT), "--kv-tokenizer", tokenizer]


def kv_children(svc: LLMService) -> list[dict[str, Any]]:
    """The Valkey Deployment and Service when the operator deploys the shared tier; else nothing."""
    shared = svc.spec.kv_cache.shared
    if shared is None or shared.endpoint is not None:
        return []
    return [build_kv_server_deployment(svc), build_kv_server_service(svc)]


def build_kv_server_deployment(svc: LLMService) -> dict[str, Any]:
    shared = svc.spec.kv_cache.shared
    assert shared is not None
    maxmemory = to_bytes(shared.size)
    container = {
        "name": "valkey",
        "image": shared.image,
        # requirepass from a config file written from the Secret at start, so the password is in
        # neither the pod spec nor the server's command line; the arguments follow the file.
        "command": ["sh", "-c", VALKEY_START, "valkey-server"],
        "env": [from_secret(VALKEY_PASSWORD_ENV, admin_secret_name(svc), KV_PASSWORD_FIELD)],
        "volumeMounts": [{"name": "auth", "mountPath": VALKEY_AUTH_DIR}],
        "args": [
            "--port",
            str(VALKEY_PORT),
            "--maxmemory",
            str(maxmemory),
            "--maxmemory-policy",
            "allkeys-lru",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ],
        "ports": [{"name": "valkey", "containerPort": VALKEY_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": VALKEY_PORT}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": VALKEY_PORT}, "periodSeconds": 10},
        # maxmemory counts values; the process needs room for its own structures on top.
        "resources": {
            "requests": {"cpu": "250m", "memory": str(int(maxmemory * 1.25))},
            "limits": {"memory": str(int(maxmemory * 1.5))},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": 999,
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": kv_server_name(svc),
            "namespace": svc.namespace,
            "labels": common_labels(svc, COMPONENT),
        },
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector_labels(svc, COMPONENT)},
            "template": {
                "metadata": {"labels": common_labels(svc, COMPONENT)},
                "spec": {
                    "enableServiceLinks": False,
                    "containers": [container],
                    "volumes": [{"name": "auth", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}],
                },
            },
        },
    }


def build_kv_server_service(svc: LLMService) -> dict[str, Any]:
    return cluster_ip_service(svc, kv_server_name(svc), COMPONENT, "valkey", VALKEY_PORT, VALKEY_PORT)
