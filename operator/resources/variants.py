"""One Deployment per hardware variant, behind the service's one Service and router. Pure.

What it is: :func:`variant_service`, the LLMService as one variant sees it (its
accelerator, CPU and memory, node selector and tolerations, engine arguments
and Manual capacity folded into the spec), which every single-shape builder
and the profile hash then take as they are; :func:`build_variant_deployment`,
that service's Deployment named ``<service>-<variant>``, its pods labelled
``plimsoll.dev/variant=<variant>`` (the selector keeps variants apart; the
Service, the PodDisruptionBudget and the router select every variant's pods by
the labels they share); and :func:`combine_deployments`, the variants' Deployments
added up for ``status.replicas`` and ``Ready``.

The variant Deployments carry no ``spec.replicas``: the replica planner sets each
one's count (``handlers/replica_writer.py``, the only writer), reconcile applies
the rest, so neither undoes the other.

What it is not: the choice of counts (``operator/scaling/variant_planner.py``) or any I/O.
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.spec import GPUSpec
from plimsoll.operator.api.variants import GPU_PRODUCT_LABEL, VariantSpec
from plimsoll.operator.resources.deployment import build_deployment
from plimsoll.operator.resources.labels import LLMSERVICE_LABEL
from plimsoll.operator.resources.settings import BuildSettings

VARIANT_LABEL = "plimsoll.dev/variant"


def variant_service(svc: LLMService, variant: VariantSpec) -> LLMService:
    """``svc`` with ``variant``'s hardware, placement, engine arguments and Manual capacity in its spec."""
    spec = svc.spec
    resources = spec.resources
    if variant.accelerator is not None:
        gpu = GPUSpec(count=variant.accelerator.count, resource_name=variant.accelerator.resource())
        resources = resources.model_copy(update={"gpu": gpu})
    resources = resources.model_copy(
        update={"cpu": variant.cpu or resources.cpu, "memory": variant.memory or resources.memory}
    )
    selector = {**spec.scheduling.node_selector, **variant.node_selector}
    if variant.accelerator is not None and variant.accelerator.type is not None:
        selector[GPU_PRODUCT_LABEL] = variant.accelerator.type
    scheduling = spec.scheduling.model_copy(
        update={
            "node_selector": selector,
            "tolerations": [*spec.scheduling.tolerations, *variant.tolerations],
        }
    )
    engine = spec.engine.model_copy(update={"args": [*spec.engine.args, *variant.engine_args]})
    capacity = spec.capacity
    if variant.concurrency_per_replica is not None:
        capacity = capacity.model_copy(update={"concurrency_per_replica": variant.concurrency_per_replica})
    one = spec.model_copy(
        update={"resources": resources, "scheduling": scheduling, "engine": engine, "capacity": capacity,
                "variants": []}
    )  # fmt: skip
    return svc.model_copy(update={"spec": one})


def variant_deployment_name(service: str, variant: str) -> str:
    """``<service>-<variant>``: the Deployment of one variant of the LLMService named ``service``."""
    return f"{service}-{variant}"


def variant_selector(svc: LLMService, variant: str) -> str:
    """Label selector of one variant's pods."""
    return f"{LLMSERVICE_LABEL}={svc.name},{VARIANT_LABEL}={variant}"


def variants_selector(svc: LLMService) -> str:
    """Label selector of every variant Deployment (and pod) of ``svc``."""
    return f"{LLMSERVICE_LABEL}={svc.name},{VARIANT_LABEL}"


def build_variant_deployment(
    svc: LLMService, variant: VariantSpec, settings: BuildSettings
) -> dict[str, Any]:
    """The Deployment of one variant, without ``spec.replicas`` (the replica planner sets it)."""
    deployment = build_deployment(variant_service(svc, variant), settings)
    deployment["metadata"]["name"] = variant_deployment_name(svc.name, variant.name)
    body = deployment["spec"]
    del body["replicas"]
    for labels in (deployment["metadata"]["labels"], body["selector"]["matchLabels"],
                   body["template"]["metadata"]["labels"]):  # fmt: skip
        labels[VARIANT_LABEL] = variant.name
    return deployment


def combine_deployments(deployments: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The variants' Deployments as one, for status: counts added up, rolled out when every one is.

    None when none exists yet. Conditions are the first failing one's (a quota, a stuck rollout).
    """
    if not deployments:
        return None
    total = {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0}
    desired = 0
    rolled_out = True
    conditions: list[dict[str, Any]] = []
    for deployment in deployments:
        status = deployment.get("status") or {}
        for key in total:
            total[key] += int(status.get(key, 0) or 0)
        desired += int((deployment.get("spec") or {}).get("replicas", 0) or 0)
        observed = status.get("observedGeneration")
        rolled_out = (
            rolled_out
            and observed is not None
            and observed >= (deployment["metadata"].get("generation") or 0)
        )
        failing = [
            c for c in status.get("conditions") or []
            if (c.get("type") == "ReplicaFailure" and c.get("status") == "True")
            or c.get("reason") == "ProgressDeadlineExceeded"
        ]  # fmt: skip
        if failing and not conditions:
            conditions = failing
    return {
        "metadata": {"generation": 1},
        # What status reads as "desired" (the planner's counts added up); a view, never written back.
        "spec": dict(replicas=desired),
        "status": {**total, "observedGeneration": 1 if rolled_out else 0, "conditions": conditions},
    }


def label_variant(obj: dict[str, Any], variant: str) -> dict[str, Any]:
    """Add the variant label to an object and, when it has one, its pod template (a profile Job)."""
    obj["metadata"].setdefault("labels", {})[VARIANT_LABEL] = variant
    template = (obj.get("spec") or {}).get("template")
    if template is not None:
        template.setdefault("metadata", {}).setdefault("labels", {})[VARIANT_LABEL] = variant
    return obj
