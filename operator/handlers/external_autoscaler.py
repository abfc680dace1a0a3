"""Apply or remove the HPA / KEDA ScaledObject of an LLMService (``autoscaling.mode: hpa | keda``).

What it is: :func:`ensure_external_autoscaler`, called at the end of every
reconcile. In ``hpa`` mode it server-side-applies the HorizontalPodAutoscaler
built by ``resources/external_autoscaler.py``; in ``keda`` mode the
ScaledObject, but only when the API server serves ``keda.sh/v1alpha1``
ScaledObjects — otherwise ``ScalingLimited=True`` (``KedaNotInstalled``) and a
Warning Event say so. In any other mode it deletes the one it made before, so
switching back to ``builtin`` or ``off`` leaves no second autoscaler behind.
Both objects are owned by the LLMService (garbage-collected with it) and target
its scale subresource: they write ``spec.replicas`` and reconcile only follows
it, so the operator and the external autoscaler never fight over the count.

What it is not: the builders (pure, in ``resources``) or the built-in loop
(``handlers/replica_planning.py``, idle in these modes).
"""

from typing import cast

import kopf

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import ConditionStatus, ConditionUpdate
from plimsoll.operator.handlers.handler_types import BodyLike, Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.ownership import apply_owned, delete_owned
from plimsoll.operator.handlers.status_writer import set_conditions
from plimsoll.operator.resources.external_autoscaler import (
    KEDA_API_VERSION,
    build_hpa,
    build_scaled_object,
)
from plimsoll.operator.scaling.inputs import per_replica_target
from plimsoll.operator.scaling.sizing import WAITING_FOR_TARGET, NoTargetError

# (apiVersion, kind) of the two objects.
HPA = ("autoscaling/v2", "HorizontalPodAutoscaler")
SCALED_OBJECT = (KEDA_API_VERSION, "ScaledObject")
KEDA_NOT_INSTALLED = "KedaNotInstalled"
EXTERNAL = "ExternalAutoscaler"
# ScalingLimited reasons this module sets; a later mode must not inherit them.
_OUR_REASONS = (KEDA_NOT_INSTALLED, EXTERNAL, WAITING_FOR_TARGET)


async def _delete_ours(
    kube: Kube,
    kind: tuple[str, str],
    body: BodyLike,
    svc: LLMService,
    logger: Log,
) -> None:
    """Delete the object of ``kind`` named after the service, if this LLMService owns it."""
    api_version, label = kind
    if not await delete_owned(kube, body, api_version, label, svc.namespace, svc.name):
        return  # absent, or someone else's: never remove an autoscaler someone else made
    message = f"deleted {label}/{svc.name}: autoscaling.mode is {svc.spec.autoscaling.mode}"
    logger.info(message)
    kopf.info(cast(kopf.Body, body), reason="Deleted", message=message)


async def _set_limited(
    kube: Kube, svc: LLMService, status: ConditionStatus, reason: str, message: str
) -> bool:
    """Set ScalingLimited on the freshest copy of the object (resourceVersion precondition)."""
    update: tuple[ConditionUpdate, ...] = (("ScalingLimited", status, reason, message),)
    changed: bool = await set_conditions(kube, svc.namespace, svc.name, update, svc.metadata.generation)
    return changed


async def _hand_back_condition(kube: Kube, body: BodyLike, svc: LLMService) -> None:
    """After leaving hpa/keda mode, replace a ScalingLimited this module set (the built-in loop
    rewrites it on its next tick; with mode off nobody else would)."""
    conditions = (body.get("status") or {}).get("conditions") or []
    current = next((c for c in conditions if c.get("type") == "ScalingLimited"), None)
    if current is None or current.get("reason") not in _OUR_REASONS:
        return
    mode = svc.spec.autoscaling.mode
    reason = "AutoscalingOff" if mode == "off" else "BuiltinAutoscaler"
    await _set_limited(kube, svc, "False", reason, f"autoscaling.mode is {mode}")


async def ensure_external_autoscaler(kube: Kube, body: BodyLike, svc: LLMService, logger: Log) -> None:
    """Make the cluster hold exactly the external autoscaler ``autoscaling.mode`` asks for."""
    mode = svc.spec.autoscaling.mode
    keda_served = await kube.has_resource(KEDA_API_VERSION, "scaledobjects")
    if mode != "hpa":
        await _delete_ours(kube, HPA, body, svc, logger)
    if mode != "keda" and keda_served:
        await _delete_ours(kube, SCALED_OBJECT, body, svc, logger)
    if mode not in ("hpa", "keda"):
        await _hand_back_condition(kube, body, svc)
        return

    owner = cast(kopf.Body, body)
    profiled = ((body.get("status") or {}).get("capacity") or {}).get("concurrencyPerReplica")
    try:
        target = per_replica_target(svc.spec, profiled)
    except NoTargetError as error:
        # Unknown, not True: nothing is limited yet, there is just no autoscaler to ask.
        await _set_limited(
            kube,
            svc,
            "Unknown",
            WAITING_FOR_TARGET,
            f"no {mode} autoscaler yet, it needs the target: {error}",
        )
        return
    if mode == "keda" and not keda_served:
        message = (
            "autoscaling.mode is keda, but the API server does not serve keda.sh/v1alpha1 ScaledObjects "
            "(KEDA is not installed); install KEDA, or set autoscaling.mode to hpa or builtin. "
            "Replicas stay at spec.replicas until then"
        )
        if await _set_limited(kube, svc, "True", KEDA_NOT_INSTALLED, message):
            kopf.warn(owner, reason=KEDA_NOT_INSTALLED, message=message)
        return

    kind = HPA if mode == "hpa" else SCALED_OBJECT
    obj = build_hpa(svc, target.value) if mode == "hpa" else build_scaled_object(svc, target.value)
    if await apply_owned(kube, owner, obj):  # OwnershipConflict (nothing touched) when an HPA of that name is not ours
        message = f"created {kind[1]}/{svc.name} on {target.value:g} in flight per replica ({target.source})"
        logger.info(message)
        kopf.info(owner, reason="Created", message=message)
    await _set_limited(
        kube, svc, "False", EXTERNAL,
        f"replicas are decided by {kind[1]} {svc.name} (target {target.value:g} in flight per replica, "
        f"from {target.source}, bounds {svc.spec.scaling.min if svc.spec.scaling else '?'}.."
        f"{svc.spec.scaling.max if svc.spec.scaling else '?'})",
    )  # fmt: skip
