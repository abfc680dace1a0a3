"""Hardware variants of one LLMService (``spec.variants``, ``spec.mix``): what each costs and where it runs.

A variant is one way of serving the same model: an accelerator (a GPU product and
count, a MIG slice, or CPU), where it may be scheduled (node selector,
tolerations), extra engine arguments, its price per replica-hour, replica bounds
and whether it runs on spot capacity. Each variant becomes its own Deployment
behind the service's one Service and router; each is profiled on its own; the
replica planner chooses how many of each to run (``operator/scaling/variant_mix.py``).
``spec.mix`` bounds that choice (spot exposure) and says when a variant counts
as unavailable.

These models are part of the CRD schema; cross-field rules are CEL here and
pydantic validators, as in ``spec.py``. No I/O.
"""

from typing import Annotated

from pydantic import ConfigDict, Field, model_validator

from plimsoll.operator.api.base import APIModel, FreeForm, Quantity, cel

# Kubernetes names of what NVIDIA's device plugin and GPU feature discovery publish.
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
# A variant's name ends Deployment and pod names (<service>-<variant>-<hash>-<id>).
VARIANT_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
VARIANT_NAME_MAX = 20
# Few enough for the exact mix search, and a bound the API server's CEL cost estimate needs.
MAX_VARIANTS = 8


class AcceleratorSpec(APIModel):
    """What one replica of a variant runs on: GPUs of a product, a MIG slice, or none (CPU)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!(has(self.migProfile) && has(self.resourceName))",
                    "accelerator.migProfile names the resource (nvidia.com/mig-<profile>); drop resourceName",
                ),
                cel(
                    "!has(self.migProfile) || !has(self.count) || self.count >= 1",
                    "accelerator.migProfile needs count of at least 1 (slices per replica)",
                ),
            ]
        }
    )

    type: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        description=f"GPU product, matched against the node label {GPU_PRODUCT_LABEL} that GPU feature "
        "discovery sets (e.g. NVIDIA-H100-80GB-HBM3, NVIDIA-L4).",
    )
    count: int = Field(1, ge=0, description="GPUs (or MIG slices) per replica; 0 runs the replica on CPU.")
    mig_profile: str | None = Field(
        None,
        pattern=r"^[0-9]+g\.[0-9]+gb$",
        description="A MIG slice instead of whole GPUs, e.g. 1g.10gb: requests "
        f"{MIG_RESOURCE_PREFIX}<profile> (the device plugin's mixed strategy).",
    )
    resource_name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9.-]+/[A-Za-z0-9._-]+$",
        description=f"Extended resource counting the accelerator (default {GPU_RESOURCE}).",
    )

    @model_validator(mode="after")
    def _one_resource(self) -> "AcceleratorSpec":
        if self.mig_profile is not None and self.resource_name is not None:
            raise ValueError(
                "accelerator.migProfile names the resource (nvidia.com/mig-<profile>); drop resourceName"
            )
        if self.mig_profile is not None and self.count < 1:
            raise ValueError("accelerator.migProfile needs count of at least 1 (slices per replica)")
        return self

    def resource(self) -> str:
        """The extended resource a replica requests ``count`` of."""
        if self.mig_profile is not None:
            return f"{MIG_RESOURCE_PREFIX}{self.mig_profile}"
        return self.resource_name or GPU_RESOURCE


class VariantSpec(APIModel):
    """One hardware variant: its own Deployment, profile, price and replica bounds."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
                    "variants[].minReplicas must not exceed maxReplicas",
                ),
            ]
        }
    )

    name: str = Field(
        min_length=1,
        max_length=VARIANT_NAME_MAX,
        pattern=VARIANT_NAME_PATTERN,
        description="Variant name (a DNS label): the Deployment is <service>-<name>, its pods carry "
        "plimsoll.dev/variant=<name>.",
    )
    cost_per_hour: float = Field(
        gt=0,
        description="What one replica of this variant costs per hour (any currency, the same for every "
        "variant): the planner minimises the sum.",
    )
    spot: bool = Field(
        False, description="Runs on spot (preemptible) capacity; spec.mix.maxSpotFraction bounds it."
    )
    min_replicas: int = Field(0, ge=0, description="Fewest replicas of this variant (an on-demand floor).")
    max_replicas: int = Field(ge=1, description="Most replicas of this variant.")
    accelerator: AcceleratorSpec | None = Field(
        None, description="GPU product and count, or MIG slice, per replica; unset: spec.resources.gpu."
    )
    cpu: Quantity | None = Field(
        None, description="CPU request and limit per replica; unset: spec.resources.cpu."
    )
    memory: Quantity | None = Field(
        None, description="Memory request and limit per replica; unset: spec.resources.memory."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels this variant needs, on top of spec.scheduling.nodeSelector.",
    )
    tolerations: list[FreeForm] = Field(
        default_factory=list,
        description="Tolerations added to spec.scheduling.tolerations (e.g. the taint of a spot node pool).",
    )
    engine_args: list[str] = Field(
        default_factory=list, description="Engine arguments appended to spec.engine.args for this variant."
    )
    concurrency_per_replica: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="capacity.mode Manual: in-flight requests one replica of this variant carries "
        "(default spec.capacity.concurrencyPerReplica). Profile mode measures it per variant.",
    )
    requests_per_second_per_replica: float | None = Field(
        None,
        gt=0,
        description="capacity.mode Manual: requests/s one replica of this variant finishes at its "
        "concurrencyPerReplica. Given for every variant, the mix compares variants and sizes demand in "
        "requests/s (as a profile measures it); otherwise in in-flight requests.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> "VariantSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"variants[{self.name}].minReplicas ({self.min_replicas}) must not exceed maxReplicas "
                f"({self.max_replicas})"
            )
        return self


class MixSpec(APIModel):
    """How the replica planner mixes variants (with spec.variants only)."""

    max_spot_fraction: float = Field(
        1.0,
        ge=0,
        le=1,
        description="At most this share of the chosen mix's capacity on spot variants (1: no limit; 0: none).",
    )
    rebalance_threshold: float = Field(
        0.1,
        ge=0,
        le=10,
        description="Move to the cheapest mix for the demand when the running one costs this much more "
        "(0.1: 10%); new replicas come up before the replaced ones are drained.",
    )
    unschedulable_seconds: int = Field(
        30,
        ge=1,
        description="A variant whose pods stay unschedulable this long (no node fits: spot capacity "
        "reclaimed, a pool at its limit) counts as unavailable; its capacity moves to the others.",
    )
    drain_seconds: int = Field(
        120,
        ge=0,
        description="The longest a replica the mix removes is drained (no new requests, in-flight ones "
        "finish) before its variant's count is lowered.",
    )
    unavailable_seconds: int = Field(
        300,
        ge=1,
        description="How long an unavailable variant is left out of the mix before it is tried again.",
    )
