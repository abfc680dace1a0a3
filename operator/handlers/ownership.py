"""The one ownership rule: the operator changes or deletes only objects its LLMService owns.

What it is: every apply, create or delete of a child with a fixed name (the replicas'
Deployment and Service, ``<name>-router``, ``<name>-profiler``, the admin Secret, a
report ConfigMap, an HPA …) goes through here. An object of that name that already
exists and carries no ownerReference to this LLMService (by uid) is someone else's:
it is left exactly as it is (no adoption, no server-side apply, no delete), and
:func:`report_conflicts` sets ``OwnershipConflict=True`` (and ``Ready=False``) with a
message naming the objects, plus a Warning Event when that message is new. A pass
without conflicts sets it back to False. Nothing is raised to kopf, so a conflict is
never retried in a loop; the periodic reconcile picks it up once the object is renamed
or removed.

What it is not: garbage collection (ownerReferences do that), nor the builders.
"""

from __future__ import annotations

import logging
from typing import Any, Final, TypeAlias, cast

import kopf

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import ConditionUpdate
from plimsoll.operator.handlers.handler_types import BodyLike
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.status_writer import MAX_MESSAGE, update_status, with_conditions

OWNERSHIP_CONDITION: Final = "OwnershipConflict"
NOT_OWNED_REASON = "ObjectNotOwned"

log = logging.getLogger("plimsoll.operator.ownership")


class OwnershipConflict(Exception):
    """An object the LLMService would write exists and belongs to someone else."""

    def __init__(self, obj: dict[str, Any]) -> None:
        self.label = describe(obj)
        super().__init__(f"{self.label} exists and is not owned by this LLMService")


def describe(obj: dict[str, Any]) -> str:
    """``Deployment web`` (kind and name, as an Event names an object)."""
    return f"{obj.get('kind', '?')} {obj['metadata']['name']}"


Owner: TypeAlias = BodyLike | LLMService


def _uid(owner: Owner) -> str | None:
    if isinstance(owner, LLMService):
        known: str | None = owner.metadata.uid
        return known
    uid = cast(dict[str, Any], owner["metadata"]).get("uid")
    return str(uid) if uid else None


def owned_by(obj: dict[str, Any], owner: Owner) -> bool:
    """Whether ``obj`` has an ownerReference to ``owner`` (matched by uid, which a name cannot fake)."""
    uid = _uid(owner)
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return uid is not None and any(ref.get("uid") == uid for ref in refs)


async def existing_owned(kube: Kube, owner: BodyLike, obj: dict[str, Any]) -> dict[str, Any] | None:
    """The stored copy of ``obj`` (None when absent); OwnershipConflict when it is someone else's."""
    meta = obj["metadata"]
    stored: dict[str, Any] | None = await kube.get(
        obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]
    )
    if stored is not None and not owned_by(stored, owner):
        raise OwnershipConflict(stored)
    return stored


async def apply_owned(kube: Kube, owner: BodyLike, obj: dict[str, Any]) -> bool:
    """Adopt and server-side apply ``obj`` unless someone else owns it; True when it was created."""
    kopf.adopt(obj, owner=cast(kopf.Body, owner))
    before = await existing_owned(kube, owner, obj)
    await kube.apply(obj)
    return before is None


async def delete_owned(
    kube: Kube, owner: Owner, api_version: str, kind: str, namespace: str, name: str
) -> bool:
    """Delete the object when this LLMService owns it; False (and nothing touched) otherwise."""
    stored = await kube.get(api_version, kind, namespace, name)
    if stored is None:
        return False
    if not owned_by(stored, owner):
        log.info("left %s %s/%s alone: not owned by this LLMService", kind, namespace, name)
        return False
    deleted: bool = await kube.delete(api_version, kind, namespace, name)
    return deleted


def has_conflict(owner: BodyLike) -> bool:
    """Whether the owner's status (as last read) reports OwnershipConflict=True."""
    conditions = (owner.get("status") or {}).get("conditions") or []
    return any(c.get("type") == OWNERSHIP_CONDITION and c.get("status") == "True" for c in conditions)


def conflict_message(labels: list[str]) -> str:
    names = ", ".join(sorted(set(labels)))
    return (
        f"{names} already exist(s) and belong(s) to someone else (no ownerReference to this LLMService), "
        "so the operator leaves them untouched; rename this LLMService or remove those objects"
    )[:MAX_MESSAGE]


async def report_conflicts(kube: Kube, owner: BodyLike, labels: list[str], *, ready: bool = True) -> bool:
    """Set ``OwnershipConflict`` (True naming ``labels``, or back to False); a Warning Event when it is new.

    ``ready``: also set ``Ready=False`` with the same reason while conflicts last (the replicas'
    own objects are not ours, so nothing is served). Returns whether a conflict is reported.
    """
    meta = owner["metadata"]
    generation = meta.get("generation")
    message = conflict_message(labels) if labels else ""

    def change(status: dict[str, Any]) -> dict[str, Any] | None:
        current = next(
            (c for c in status.get("conditions") or [] if c.get("type") == OWNERSHIP_CONDITION), None
        )
        if not labels:
            if current is None or current.get("status") != "True":
                return None  # nothing to clear: no condition on services that never had a conflict
            updates: tuple[ConditionUpdate, ...] = ((OWNERSHIP_CONDITION, "False", "AllObjectsOwned", ""),)
        else:
            updates = ((OWNERSHIP_CONDITION, "True", NOT_OWNED_REASON, message),)
            if ready:
                updates += (("Ready", "False", OWNERSHIP_CONDITION, message),)
        conditions = with_conditions(status.get("conditions"), updates, generation)
        return None if conditions == status.get("conditions") else {"conditions": conditions}

    written = await update_status(kube, meta["namespace"], meta["name"], change)
    if labels and written is not None:
        before = written.condition_before(OWNERSHIP_CONDITION) or {}
        if before.get("status") != "True" or before.get("message") != message:
            kopf.warn(cast(kopf.Body, owner), reason=OWNERSHIP_CONDITION, message=message)
    return bool(labels)
