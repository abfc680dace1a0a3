"""The one writer of an LLMService's replica count (``spec.replicas``, the scale subresource's field).

What it is: :func:`write_replicas`, a JSON merge patch of the count the replica
planner decided for one pool; with ``resource_version`` it carries the
version the count was planned from as a precondition, so a count someone wrote
in the meantime is never overwritten (the API server answers 409). Reconcile
then resizes the Deployment. A merge patch on the LLMService rather than on
``/scale``: the same field, and the operator already holds ``patch`` on
llmservices, so no extra RBAC.

What it is not: a decision. Only ``replica_planning.py`` imports this module
(an import-linter contract), and a test searches the source for any other
patch of ``spec.replicas``.
"""

from typing import Any

from plimsoll.operator.api.base import API_VERSION, KIND
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.scaling.replica_plan import DEFAULT_POOL


def replicas_patch(pool: str, replicas: int) -> dict[str, Any]:
    """The spec fragment that holds ``pool``'s count."""
    if pool != DEFAULT_POOL:
        raise ValueError(
            f"no replica pool {pool!r} in an LLMService spec (only {DEFAULT_POOL!r}: spec.replicas)"
        )
    return {"spec": {"replicas": replicas}}


async def write_replicas(
    kube: Kube, namespace: str, name: str, pool: str, replicas: int, resource_version: str | None = None
) -> None:
    """Patch ``pool``'s count; raises ApiException (409 when ``resource_version`` is no longer current)."""
    patch = replicas_patch(pool, replicas)
    if resource_version:
        patch["metadata"] = {"resourceVersion": resource_version}
    await kube.merge_patch(API_VERSION, KIND, namespace, name, patch)
