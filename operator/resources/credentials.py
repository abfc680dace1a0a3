"""The credentials an LLMService's pods get: the admin key, the API key, Ray's token. Pure.

What it is: the per-LLMService Secret ``<name>-admin-key`` (a random admin key for the
replicas' control endpoints, a random Ray token for multi-node groups, a random password
for the shared KV tier's Valkey and a random key for ``POST /wake_up`` alone, the one the
routers hold; the operator
creates it once, owned by the LLMService, so it goes with it) and the environment
entries that hand each credential to a container *from a Secret*: never as a literal
in the pod spec, the args, or ``/proc/*/cmdline``. The user's inference key comes from
``engine.apiKeySecretRef`` and reaches the engine (``PLIMSOLL_API_KEY``, or vLLM's
``VLLM_API_KEY``), the router and the profile Job.

What it is not: the Secret's creation or the operator reading the admin key back
(``handlers/credentials.py``).
"""

import base64
from typing import Any

from plimsoll.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, WAKE_API_KEY_ENV
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.labels import common_labels

ADMIN_KEY_FIELD = "admin-api-key"
RAY_TOKEN_FIELD = "ray-auth-token"
KV_PASSWORD_FIELD = "kv-password"  # the operator's Valkey (spec.kvCache.shared): requirepass, and the replicas' AUTH
WAKE_KEY_FIELD = "wake-api-key"  # POST /wake_up only: what the routers hold (autoscaling.standby.routerWake)
SECRET_FIELDS = (ADMIN_KEY_FIELD, RAY_TOKEN_FIELD, KV_PASSWORD_FIELD, WAKE_KEY_FIELD)
VLLM_API_KEY_ENV = "VLLM_API_KEY"


def admin_secret_name(svc: LLMService) -> str:
    return f"{svc.name}-admin-key"


def _b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


def build_admin_secret(svc: LLMService, values: dict[str, str]) -> dict[str, Any]:
    """The Secret holding the replicas' admin key, the Ray token and the KV tier's password
    (``SECRET_FIELDS`` → values chosen by the caller)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": admin_secret_name(svc),
            "namespace": svc.namespace,
            "labels": common_labels(svc, "credentials"),
        },
        "data": {field: _b64(values[field]) for field in SECRET_FIELDS},
    }


def from_secret(env: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def api_key_env(svc: LLMService, env: str = API_KEY_ENV) -> list[dict[str, Any]]:
    """``engine.apiKeySecretRef`` as the environment variable ``env``; [] without one."""
    ref = svc.spec.engine.api_key_secret_ref
    return [] if ref is None else [from_secret(env, ref.name, ref.key)]


def router_wakes(svc: LLMService) -> bool:
    """The router wakes parked replicas itself (``autoscaling.standby.routerWake`` with a router in front)."""
    standby = svc.spec.autoscaling.standby
    return standby is not None and standby.router_wake and svc.spec.router_in_front()


def engine_credential_env(svc: LLMService) -> list[dict[str, Any]]:
    """The engine container's keys: the admin key (plimsoll) and the inference key (plimsoll, vLLM).

    SGLang reads its key only from its arguments; the spec refuses ``apiKeySecretRef`` for it.
    """
    if svc.spec.engine.kind == "plimsoll":
        wake = [from_secret(WAKE_API_KEY_ENV, admin_secret_name(svc), WAKE_KEY_FIELD)] if router_wakes(svc) else []
        return [from_secret(ADMIN_API_KEY_ENV, admin_secret_name(svc), ADMIN_KEY_FIELD), *wake, *api_key_env(svc)]
    if svc.spec.engine.kind == "vllm":
        return api_key_env(svc, VLLM_API_KEY_ENV)
    return []


def ray_auth_env(svc: LLMService) -> list[dict[str, Any]]:
    """Ray's token authentication (Ray 2.52+): every node of a group needs the same mode and token."""
    return [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        from_secret("RAY_AUTH_TOKEN", admin_secret_name(svc), RAY_TOKEN_FIELD),
    ]
