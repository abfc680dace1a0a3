"""The one way the operator writes LLMService status: re-read, merge, patch with a precondition.

What it is: :func:`update_status`. It reads the object as the API server holds it
now, asks the caller's ``change`` what the status should become *given that
copy*, and merge-patches the difference to the status subresource with the
copy's ``resourceVersion`` as a precondition. If anyone wrote the object in
between (reconcile, the autoscaler loop, the profiler, an HPA writing
``spec.replicas``), the API server answers 409 and the change is recomputed on
the fresher copy, so one writer never puts back another's conditions as they
were before. :func:`with_conditions` merges conditions through the one
condition helper (``api/status.set_condition``), which keeps
``lastTransitionTime`` when a condition's status does not change. Every status
writer in ``operator/handlers`` goes through here.

What it is not: it decides nothing about the content (``resources/readiness.py``,
``operator/scaling`` and the handlers do) and posts no Events; it tells the
caller what it wrote so the caller can.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException

from plimsoll.operator.api.base import API_VERSION, KIND
from plimsoll.operator.api.status import ConditionUpdate, set_condition
from plimsoll.operator.handlers.kube import Kube

# Given the status as stored now, the fields to merge-patch; None when nothing should be written.
StatusChange = Callable[[dict[str, Any]], dict[str, Any] | None]

# A condition message is capped by the API (32 KiB); keep ours readable anyway.
MAX_MESSAGE = 1000
# Each conflict means another writer just wrote; five in a row means the object is very busy.
ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class StatusWrite:
    """What :func:`update_status` found and wrote."""

    before: dict[str, Any]  # the status it computed the change from
    patch: dict[str, Any]  # the fields it wrote

    def condition_before(self, type_: str) -> dict[str, Any] | None:
        return next((c for c in self.before.get("conditions") or [] if c.get("type") == type_), None)


def with_conditions(
    conditions: list[dict[str, Any]] | None,
    updates: Iterable[ConditionUpdate],
    observed_generation: int | None,
) -> list[dict[str, Any]]:
    """``conditions`` with each update set (others kept as they are); messages are capped."""
    merged = list(conditions or [])
    for type_, state, reason, message in updates:
        merged = set_condition(
            merged, type_, state, reason, message[:MAX_MESSAGE], observed_generation=observed_generation
        )
    return merged


def _differs(status: dict[str, Any], patch: dict[str, Any] | None) -> bool:
    return bool(patch) and any(status.get(k) != v for k, v in (patch or {}).items())


async def update_status(
    kube: Kube,
    namespace: str,
    name: str,
    change: StatusChange,
    seen: dict[str, Any] | None = None,
) -> StatusWrite | None:
    """Apply ``change`` to the freshest status of LLMService ``namespace/name``; None when nothing changed.

    ``seen`` is the status the caller already holds (a kopf body): when ``change``
    finds nothing to write against it, no request is made at all, which keeps the
    steady state (a resync that changes nothing) free of reads. A write always
    starts from a fresh read. Raises kopf.TemporaryError when the object changed
    under every attempt; an object that is gone is not written.
    """
    if seen is not None and not _differs(seen, change(seen)):
        return None
    for _ in range(ATTEMPTS):
        obj = await kube.get(API_VERSION, KIND, namespace, name)
        if obj is None:
            return None
        status = dict(obj.get("status") or {})
        patch = change(status)
        if patch is None or not _differs(status, patch):
            return None
        try:
            await kube.patch_status(
                API_VERSION, KIND, namespace, name, patch, resource_version=obj["metadata"]["resourceVersion"]
            )
        except ApiException as error:
            if error.status == 409:
                continue  # someone wrote since the read: recompute on their version
            if error.status == 404:
                return None
            raise
        return StatusWrite(before=status, patch=patch)
    raise kopf.TemporaryError(
        f"status of {namespace}/{name} kept changing under the operator; retrying", delay=2
    )


async def set_conditions(
    kube: Kube,
    namespace: str,
    name: str,
    updates: tuple[ConditionUpdate, ...],
    observed_generation: int | None,
    fields: dict[str, Any] | None = None,
) -> bool:
    """Set only these conditions (and ``fields``, e.g. capacity) on the freshest copy; True when written."""

    def change(status: dict[str, Any]) -> dict[str, Any]:
        conditions = with_conditions(status.get("conditions"), updates, observed_generation)
        return {"conditions": conditions, **(fields or {})}

    return await update_status(kube, namespace, name, change) is not None
