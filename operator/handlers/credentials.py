"""The per-LLMService credentials Secret: created once with random values, read back by the operator.

What it is: :func:`ensure_credentials` (reconcile calls it before the replicas' workload,
whose pods read the Secret through ``secretKeyRef``) creates ``<name>-admin-key`` with a
random admin key, Ray token and KV-tier password when it is missing — never rewriting a
value, so running replicas keep working; a field added since the Secret was made is
patched in — and :func:`admin_key` reads the admin key back for the
operator's own calls to the replicas (``replica_client.py``). Keys are cached per
LLMService uid; a Secret of that name that this LLMService does not own is an
OwnershipConflict and is never read.

What it is not: the Secret's shape or the pods' env (``resources/credentials.py``), or
the user's inference key (``engine.apiKeySecretRef``; the operator never reads it: the
admin key is accepted on ``/v1/*`` too).
"""

from __future__ import annotations

import base64
import secrets
import time
from typing import cast

import kopf
from kubernetes_asyncio.client.exceptions import ApiException

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.handler_types import BodyLike
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.ownership import existing_owned, owned_by
from plimsoll.operator.resources.credentials import (
    ADMIN_KEY_FIELD,
    SECRET_FIELDS,
    admin_secret_name,
    build_admin_secret,
)

# (namespace, uid) -> admin key; a new LLMService of the same name has a new uid and a new Secret.
_admin_keys: dict[tuple[str, str], str] = {}
# (namespace, uid) -> when the Secret was last seen in place (monotonic seconds).
_seen: dict[tuple[str, str], float] = {}
RECHECK_S = 300.0


async def ensure_credentials(kube: Kube, body: BodyLike, svc: LLMService) -> bool:
    """Create the Secret when it is missing; True when it was created. Raises OwnershipConflict.

    Once seen in place it is looked at again only every ``RECHECK_S``: reconcile runs every few
    seconds for every LLMService, and the Secret never changes once made.
    """
    key = (svc.namespace, svc.metadata.uid or "")
    if time.monotonic() - _seen.get(key, -RECHECK_S) < RECHECK_S:
        return False
    obj = build_admin_secret(svc, {field: secrets.token_urlsafe(32) for field in SECRET_FIELDS})
    kopf.adopt(obj, owner=cast(kopf.Body, body))
    created = False
    stored = await existing_owned(kube, body, obj)
    if stored is not None:
        # A Secret made before a field existed gets that field (fresh value); present ones are never rewritten.
        missing = {k: v for k, v in obj["data"].items() if k not in (stored.get("data") or {})}
        if missing:
            # resourceVersion as a precondition: two passes adding a field at once must not both write it.
            patch = {"metadata": {"resourceVersion": stored["metadata"]["resourceVersion"]}, "data": missing}
            try:
                await kube.merge_patch("v1", "Secret", svc.namespace, admin_secret_name(svc), patch)
            except ApiException as error:
                if error.status != 409:
                    raise
                return False  # the other pass added it; look again next time
    else:
        try:
            await kube.create(obj)
            created = True
        except ApiException as error:
            if error.status != 409:
                raise
            await existing_owned(kube, body, obj)  # created meanwhile: ours (a concurrent pass) or a conflict
    if svc.metadata.uid:
        _seen[key] = time.monotonic()
    return created


async def admin_key(kube: Kube, svc: LLMService) -> str | None:
    """The replicas' admin key (plimsoll engine), or None when there is none yet or it is not ours."""
    if svc.spec.engine.kind != "plimsoll":
        return None  # vLLM has no admin endpoints of plimsoll's
    cache_key = (svc.namespace, svc.metadata.uid or "")
    if cache_key in _admin_keys:
        return _admin_keys[cache_key]
    stored = await kube.get("v1", "Secret", svc.namespace, admin_secret_name(svc))
    if stored is None or not owned_by(stored, svc):
        return None
    encoded = (stored.get("data") or {}).get(ADMIN_KEY_FIELD)
    if not encoded:
        return None
    key = base64.b64decode(encoded).decode()
    if svc.metadata.uid:
        _admin_keys[cache_key] = key
    return key
