"""One pool of a split LLMService seen as a plain one: what every replica builder works from. Pure.

What it is: :func:`pool_view`, the LLMService a pool's replicas are built from: the service with
the pool's resources and engine arguments in place of the shared ones, the KV transfer flag of its
role (``--kv-transfer-config``: ``kv_producer`` for prefill, which also holds the blocks for
``abortRequestTimeoutSeconds`` and serves them on ``kvPort``; ``kv_consumer`` for decode, which
pulls within ``transferTimeoutSeconds``), and no ``disaggregation`` of its own, so building from a
view twice changes nothing. The prefill view also carries the prefill pool's count as its replicas.
What it is not: the prefill Deployment (``pools.py``) or any I/O.
"""

from __future__ import annotations

import json
from typing import Literal

from plimsoll.operator.api.llmservice import LLMService

Role = Literal["prefill", "decode"]
ROLE_LABEL = "plimsoll.dev/role"  # the router discovers each pool by it (router/discovery.py)


def transfer_flags(svc: LLMService, role: Role) -> list[str]:
    """``--kv-transfer-config`` for ``role`` (the built-in TCP transport)."""
    d = svc.spec.disaggregation
    assert d is not None
    if role == "prefill":
        config = {"kv_role": "kv_producer", "kv_port": d.kv_port,
                  "kv_connector_extra_config": {"abort_request_timeout": d.abort_request_timeout_seconds}}  # fmt: skip
    else:
        config = {"kv_role": "kv_consumer",
                  "kv_connector_extra_config": {"transfer_timeout": d.transfer_timeout_seconds}}  # fmt: skip
    return ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]


def pool_view(svc: LLMService, role: Role) -> LLMService:
    """``svc`` as the replicas of ``role`` are built; a service that is not split is returned as it is."""
    spec = svc.spec
    d = spec.disaggregation
    if d is None:
        return svc
    pool = d.prefill if role == "prefill" else d.decode
    gpu = spec.resources.gpu
    if pool.resources.gpu_count is not None:
        gpu = gpu.model_copy(update={"count": pool.resources.gpu_count})
    resources = spec.resources.model_copy(update={
        "gpu": gpu,
        "cpu": pool.resources.cpu if pool.resources.cpu is not None else spec.resources.cpu,
        "memory": pool.resources.memory if pool.resources.memory is not None else spec.resources.memory,
    })  # fmt: skip
    engine = spec.engine.model_copy(
        update={"args": [*spec.engine.args, *pool.engine_args, *transfer_flags(svc, role)]}
    )
    update: dict[str, object] = {"resources": resources, "engine": engine, "disaggregation": None}
    if role == "prefill":
        update["replicas"] = d.prefill.desired_replicas()
    return svc.model_copy(update={"spec": spec.model_copy(update=update)})
