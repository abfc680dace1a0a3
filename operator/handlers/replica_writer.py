"""The one writer of an LLMService's replica counts (``spec.replicas``, and each hardware variant's).

What it is: :func:`write_replicas`, a JSON merge patch of the count the replica
planner decided for one pool. The default pool is the LLMService's
``spec.replicas`` (the scale subresource's field); with ``resource_version`` it
carries the version the count was planned from as a precondition, so a count
someone wrote in the meantime is never overwritten (the API server answers 409).
Reconcile then resizes the Deployment. A merge patch on the LLMService rather
than on ``/scale``: the same field, and the operator already holds ``patch`` on
llmservices, so no extra RBAC. A variant's pool (``variant/<name>``) is its
Deployment's ``spec.replicas``, written here directly: reconcile applies variant
Deployments without a count (``resources/variants.py``), so the field stays
this writer's. :func:`create_variant_deployment` creates a variant's
Deployment with its first count, for the same reason.

What it is not: a decision. Only ``replica_planning.py`` imports this module
(an import-linter contract), and a test searches the source for any other
patch of ``spec.replicas``.
"""

from typing import Any

from plimsoll.operator.api.base import API_VERSION, KIND
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.resources.variants import variant_deployment_name
from plimsoll.operator.scaling.pools import PREFILL_POOL
from plimsoll.operator.scaling.replica_plan import DEFAULT_POOL, VARIANT_POOL_PREFIX, pool_variant


def replicas_patch(pool: str, replicas: int) -> dict[str, Any]:
    """The spec fragment that holds ``pool``'s count (of the LLMService, or of a variant's Deployment)."""
    if pool == PREFILL_POOL:  # a split service's prefill pool (its decode pool is spec.replicas)
        return {"spec": {"disaggregation": {"prefill": {"replicas": replicas}}}}
    if pool != DEFAULT_POOL and pool_variant(pool) is None:
        raise ValueError(
            f"no replica pool {pool!r} in an LLMService (only {DEFAULT_POOL!r}: spec.replicas, "
            f"{PREFILL_POOL!r}: spec.disaggregation.prefill.replicas, "
            f"and {VARIANT_POOL_PREFIX}<name> for spec.variants)"
        )
    return {"spec": {"replicas": replicas}}


async def write_replicas(
    kube: Kube, namespace: str, name: str, pool: str, replicas: int, resource_version: str | None = None
) -> None:
    """Patch ``pool``'s count; raises ApiException (409 when ``resource_version`` is no longer current)."""
    patch = replicas_patch(pool, replicas)
    variant = pool_variant(pool)
    if variant is not None:
        # The variant's Deployment; resource_version is the LLMService's, not the Deployment's.
        await kube.merge_patch("apps/v1", "Deployment", namespace, variant_deployment_name(name, variant), patch)
        return
    if resource_version:
        patch["metadata"] = {"resourceVersion": resource_version}
    await kube.merge_patch(API_VERSION, KIND, namespace, name, patch)


async def create_variant_deployment(kube: Kube, deployment: dict[str, Any], replicas: int) -> None:
    """Create a variant's Deployment (owner already set) with its first count; 409 if it exists."""
    body = {**deployment, "spec": {**deployment["spec"], "replicas": replicas}}
    await kube.create(body)
