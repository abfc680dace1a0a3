"""vLLM's ``--kv-transfer-config`` for prefill/decode disaggregation, as plimsoll takes it.

What it is: :class:`KVTransferConfig`, the JSON object vLLM's flag takes, with the fields that
mean something to plimsoll's built-in transport: ``kv_connector`` (left out, or
``PlimsollConnector``: blocks move over TCP between replicas, ``transport.py``), ``kv_role``
(``kv_producer`` prefills and holds blocks for a decode replica to pull, ``kv_consumer`` pulls
them before decoding, ``kv_both`` does either per request), ``engine_id``, ``kv_ip`` and
``kv_port`` (where the producer's transfer server listens; ``kv_port`` 0 picks a free port),
and ``kv_connector_extra_config`` (``abort_request_timeout``: seconds a producer holds blocks
nobody pulls, vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``; ``transfer_timeout``: seconds a
consumer waits for one pull before it prefills locally instead; ``pull_workers``: pulls in
flight at once). A connector plimsoll does not have (``NixlConnector``, ``LMCacheConnectorV1``
…) and vLLM fields that only those connectors read are refused at start, saying so.

What it is not: the transport (``transport.py``) or the per-request protocol
(``remote_prefill.py``).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from plimsoll.runtime.kv.json_flag import json_flag

BUILTIN_CONNECTOR = "PlimsollConnector"
DEFAULT_KV_PORT = 14579  # vLLM's KVTransferConfig.kv_port default
# vLLM fields that configure other connectors (NCCL groups, NIXL buffers, plug-in modules).
_OTHER_CONNECTORS_FIELDS = frozenset({
    "kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_connector_module_path",
    "kv_load_failure_policy", "enable_permute_local_kv",
})  # fmt: skip


class TransferTuning(BaseModel):
    """``kv_connector_extra_config`` of the built-in transport."""

    model_config = ConfigDict(extra="forbid")

    abort_request_timeout: float = Field(
        480.0,
        gt=0,
        description="seconds a producer holds a prefilled request's blocks for a pull (vLLM: 480)",
    )
    transfer_timeout: float = Field(
        30.0, gt=0, description="seconds a consumer waits on one pull before it prefills locally"
    )
    pull_workers: int = Field(4, ge=1, le=64, description="pulls a consumer runs at once")


class KVTransferConfig(BaseModel):
    """vLLM's ``KVTransferConfig`` fields the built-in transport reads (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    kv_connector: str | None = None
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    engine_id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    kv_ip: str = Field("0.0.0.0", description="address the transfer server binds (a wildcard: every address)")
    kv_port: int = Field(DEFAULT_KV_PORT, ge=0, le=65535, description="its port; 0 picks a free one")
    kv_connector_extra_config: TransferTuning = Field(default_factory=lambda: TransferTuning.model_validate({}))

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            other = sorted(_OTHER_CONNECTORS_FIELDS & set(data))
            if other:
                raise ValueError(
                    f"--kv-transfer-config: {', '.join(other)} configure vLLM's other connectors and mean nothing "
                    "to plimsoll's built-in TCP transport; leave them out"
                )
        return data

    @model_validator(mode="after")
    def _known_connector(self) -> KVTransferConfig:
        if self.kv_connector not in (None, BUILTIN_CONNECTOR):
            raise ValueError(
                f"--kv-transfer-config: kv_connector {self.kv_connector!r} is not available in plimsoll; leave "
                f"kv_connector out (or name {BUILTIN_CONNECTOR!r}) to move KV blocks over the built-in TCP "
                "transport, which plimsoll replicas on both sides speak"
            )
        return self

    @classmethod
    def parse(cls, value: object) -> KVTransferConfig | None:
        if value is None or isinstance(value, KVTransferConfig):
            return value
        return cls.model_validate(json_flag(value, "--kv-transfer-config", '{"kv_role": "kv_both"}'))

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def timeouts(self) -> TransferTuning:
        return self.kv_connector_extra_config
