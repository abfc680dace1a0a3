"""``spec.disaggregation``: prefill and decode on separate pools of replicas.

What it is: the API of a split LLMService. The **decode pool is the service's replicas** (their
count is ``spec.replicas`` and the scale subresource, their bounds ``spec.scaling``, their
Deployment the one named after the service); ``decode`` here adds only what differs for them
(resources, engine arguments, the target of their signal). The **prefill pool** is
``prefill``: its own count, bounds, resources, engine arguments and Deployment
(``<name>-prefill``). The router in front sends each request to a prefill replica first (one
token, the KV blocks held) and then to a decode replica (which pulls them over the built-in TCP
transport on ``kvPort``). Each pool is profiled with its own workload and scaled on its own
signal (``operator/scaling/pools.py``).

What it is not: the builders (``operator/resources/pools.py``) or the planner's rules.
"""

from typing import Annotated

from pydantic import ConfigDict, Field, model_validator

from plimsoll.operator.api.base import APIModel, Quantity, cel, defaulted


class PoolResources(APIModel):
    """A pool's compute, where it differs from ``spec.resources`` (unset fields are taken from there)."""

    gpu_count: int | None = Field(None, ge=0, description="GPUs per replica of this pool (0: CPU).")
    cpu: Quantity | None = Field(None, description="CPU request and limit of each replica of this pool.")
    memory: Quantity | None = Field(
        None, description="Memory request and limit of each replica of this pool."
    )


# The two fields both pools declare alike (their own count, signal and profile differ).
PoolCompute = Annotated[
    PoolResources,
    defaulted(PoolResources, "Per-replica compute."),
]
PoolEngineArgs = Annotated[
    list[str], Field(default_factory=list, description="Extra engine arguments for this pool.")
]


class PoolWorkload(APIModel):
    """What a pool's profile sweeps: the request shape that exercises that pool's phase."""

    input_tokens: int = Field(ge=1, description="Prompt length of each benchmark request.")
    output_tokens: int = Field(ge=1, description="Output length of each benchmark request.")
    concurrency: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16], min_length=1, description="Closed-loop levels swept."
    )
    requests_per_level: int = Field(16, ge=1, description="Requests measured at each level.")


class PrefillPoolSpec(APIModel):
    """The prefill pool: replicas that prefill each prompt and hold its KV blocks for a decode replica."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.min <= self.max", "disaggregation.prefill.min must not exceed its max"),
                cel("!has(self.replicas) || (self.replicas >= self.min && self.replicas <= self.max)",
                    "disaggregation.prefill.replicas must lie within its min..max"),
            ]
        }
    )  # fmt: skip

    replicas: int | None = Field(
        None, ge=0, description="Prefill replicas; the built-in autoscaler writes it within min..max."
    )
    min: int = Field(1, ge=1, description="Fewest prefill replicas.")
    max: int = Field(4, ge=1, description="Most prefill replicas.")
    resources: PoolCompute
    engine_args: PoolEngineArgs
    target_backlog_seconds: float | None = Field(
        None, gt=0, description="Scaling signal target: seconds of queued prompt tokens per prefill replica "
        "(waiting prompt tokens ÷ the profiled prefill rate). Default: a quarter of slo.ttftP95Ms, else 1 s.",
    )  # fmt: skip
    profile: PoolWorkload = Field(
        default_factory=lambda: PoolWorkload(input_tokens=512, output_tokens=1),
        description="The prefill profile: long prompts, one output token; its TTFT knee gives prompt tokens/s.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> "PrefillPoolSpec":
        if self.min > self.max:
            raise ValueError(f"disaggregation.prefill.min ({self.min}) must not exceed its max ({self.max})")
        if self.replicas is not None and not self.min <= self.replicas <= self.max:
            raise ValueError(
                f"disaggregation.prefill.replicas ({self.replicas}) must lie within its min..max ({self.min}..{self.max})"
            )
        return self

    def desired_replicas(self) -> int:
        return self.replicas if self.replicas is not None else self.min


class DecodePoolSpec(APIModel):
    """What the decode pool (the service's own replicas) does differently from ``spec``."""

    resources: PoolCompute
    engine_args: PoolEngineArgs
    target_sequences_per_replica: float | None = Field(
        None, gt=0, description="Scaling signal target: running sequences per decode replica. Default: the "
        "decode profile's knee under slo.tpotP50Ms × capacity.headroom.",
    )  # fmt: skip
    target_kv_usage: float = Field(
        0.85, gt=0, le=1, description="KV-cache use per decode replica above which it counts as full."
    )
    profile: PoolWorkload = Field(
        default_factory=lambda: PoolWorkload(input_tokens=64, output_tokens=128),
        description="The decode profile: short prompts, long outputs; its TPOT knee gives sequences per replica.",
    )


class DisaggregationSpec(APIModel):
    """Prefill and decode pools (see the module docstring)."""

    prefill: PrefillPoolSpec = defaulted(PrefillPoolSpec, "The prefill pool.")
    decode: DecodePoolSpec = defaulted(
        DecodePoolSpec, "The decode pool: the service's replicas (spec.replicas, spec.scaling)."
    )
    kv_port: int = Field(
        14579, ge=1024, le=65535, description="Port of each prefill replica's KV transfer server."
    )
    transfer_timeout_seconds: float = Field(
        30.0, gt=0, description="Longest a decode replica waits on one pull before it prefills locally."
    )
    abort_request_timeout_seconds: float = Field(
        120.0, gt=0, description="Longest a prefill replica holds a prompt's blocks that nobody pulls."
    )
    link_bandwidth: str | None = Field(
        None, pattern=r"^\s*[0-9.]+\s*[kKmMgGtT]?i?(B|bit|b)(/s|ps)?\s*$",
        description="The KV link between the pools (e.g. 25GB/s, 100Gbps): with both pools profiled, "
        "status.disaggregation predicts whether the split pays and at which ratio.",
    )  # fmt: skip
