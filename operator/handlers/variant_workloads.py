"""The variant Deployments reconcile applies, and those it removes.

What it is: :func:`variant_workloads`, the reconcile step of a service with
``spec.variants``: one Deployment per variant (``resources/variants.py``), the
single-shape Deployment deleted when the spec moved to variants, and the
Deployments of variants no longer in the spec deleted; each deletion only of
objects this LLMService owns (``ownership.py``). A variant Deployment that does
not exist yet is named in ``missing``: reconcile hands those to the replica
planner's handler, which creates each with its first count (the count is the
planner's, never reconcile's), then applies all of them without a count.
:func:`remove_variant_workloads` is the other direction: a spec without variants
deletes what the variants left. :func:`replicas_for_status` is what status and
``Ready`` are computed from: the one Deployment, or the variants' added up.

What it is not: the builders or any count.
"""

from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.handler_types import Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.ownership import delete_owned, owned_by
from plimsoll.operator.resources.settings import BuildSettings
from plimsoll.operator.resources.variants import (
    VARIANT_LABEL,
    build_variant_deployment,
    combine_deployments,
    variants_selector,
)


@dataclass(frozen=True)
class VariantWorkloads:
    """What reconcile applies for the variants, what it must create first, what it deleted."""

    objs: list[dict[str, Any]]
    missing: list[dict[str, Any]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


async def _variant_deployments(kube: Kube, svc: LLMService) -> list[dict[str, Any]]:
    found = await kube.list_objects(
        "apps/v1", "Deployment", svc.namespace, label_selector=variants_selector(svc)
    )
    return [d for d in found if not d["metadata"].get("deletionTimestamp")]


async def variant_workloads(
    kube: Kube, svc: LLMService, settings: BuildSettings, logger: Log
) -> VariantWorkloads:
    """The variants' Deployments for ``svc`` (see the module docstring)."""
    removed: list[str] = []
    if await delete_owned(kube, svc, "apps/v1", "Deployment", svc.namespace, svc.name):
        logger.info("deleted Deployment %s: the service now runs variants", svc.name)
        removed.append(f"Deployment/{svc.name}")
    wanted = [build_variant_deployment(svc, v, settings) for v in svc.spec.variants]
    names = {d["metadata"]["name"] for d in wanted}
    existing = await _variant_deployments(kube, svc)
    for deployment in existing:
        name = deployment["metadata"]["name"]
        if name not in names and await delete_owned(kube, svc, "apps/v1", "Deployment", svc.namespace, name):
            logger.info("deleted Deployment %s: its variant left spec.variants", name)
            removed.append(f"Deployment/{name}")
    have = {d["metadata"]["name"] for d in existing}
    return VariantWorkloads(wanted, [d for d in wanted if d["metadata"]["name"] not in have], removed)


async def remove_variant_workloads(kube: Kube, svc: LLMService, logger: Log) -> list[str]:
    """Delete the variant Deployments a spec without variants left behind; what was deleted."""
    removed = []
    for deployment in await _variant_deployments(kube, svc):
        name = deployment["metadata"]["name"]
        if owned_by(deployment, svc) and await delete_owned(
            kube, svc, "apps/v1", "Deployment", svc.namespace, name
        ):
            logger.info("deleted Deployment %s: spec.variants is empty", name)
            removed.append(f"Deployment/{name}")
    return removed


async def replicas_for_status(kube: Kube, svc: LLMService) -> dict[str, Any] | None:
    """The replicas' Deployment as status reads it: the service's own, or its variants' added up."""
    if not svc.spec.variants:
        return await kube.get("apps/v1", "Deployment", svc.namespace, svc.name)
    wanted = {v.name for v in svc.spec.variants}
    deployments = [
        d for d in await _variant_deployments(kube, svc)
        if (d["metadata"].get("labels") or {}).get(VARIANT_LABEL) in wanted
    ]  # fmt: skip
    return combine_deployments(deployments)
