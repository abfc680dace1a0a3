"""Initial sizing: write the starting replica count of an LLMService that has none.

What it is: :func:`apply_start_size`, called by reconcile before the Deployment
is built. It asks :func:`plimsoll.operator.scaling.starting_size.plan_start`
what to do, writes ``spec.replicas`` (a merge patch carrying the object's
resourceVersion, so a count the autoscaler or an HPA wrote in the meantime is
never overwritten), records the arithmetic in ``status.sizing`` and posts an
``InitialSizing`` Event, so ``kubectl describe llms`` shows how the number came
about. It returns the service with the count filled in, so the Deployment of
this same reconcile starts at it.

What it is not: the sizing rule (``operator/scaling``) or an autoscaler; once
``spec.replicas`` is set this does nothing.
"""

import logging
from typing import Any, cast

import kopf
from kubernetes_asyncio.client.exceptions import ApiException

from plimsoll.operator.api.base import API_VERSION, KIND
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import now_rfc3339
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.status_writer import update_status
from plimsoll.operator.scaling.starting_size import StartPlan, plan_start


async def _write_replicas(kube: Kube, body: kopf.Body | dict[str, Any], replicas: int) -> None:
    meta = body["metadata"]
    patch: dict[str, Any] = {"spec": {"replicas": replicas}}
    if meta.get("resourceVersion"):
        # Precondition: if anyone changed the object since we read it, the API server answers 409.
        patch["metadata"] = {"resourceVersion": meta["resourceVersion"]}
    await kube.merge_patch(API_VERSION, KIND, meta["namespace"], meta["name"], patch)


def _same(previous: dict[str, Any] | None, plan: StartPlan) -> bool:
    if not previous:
        return False
    fresh = plan.to_status("")
    return all(previous.get(k) == v for k, v in fresh.items() if k != "time")


async def apply_start_size(
    kube: Kube,
    body: kopf.Body | dict[str, Any],
    svc: LLMService,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> LLMService:
    """Size a service without ``spec.replicas``; return it with the count this reconcile should use."""
    status = dict(body.get("status") or {})
    profiled = (status.get("capacity") or {}).get("concurrencyPerReplica")
    plan = plan_start(svc.spec, profiled)
    if plan is None:
        return svc
    if plan.write:
        try:
            await _write_replicas(kube, body, plan.replicas)
        except ApiException as error:
            if error.status != 409:
                raise
            # Someone (an autoscaler, the user) wrote the object first; the next reconcile re-reads it.
            logger.info("initial sizing skipped: the LLMService changed since it was read")
            return svc
        logger.info("initial sizing: %s", plan.event_message())

    def change(current: dict[str, Any]) -> dict[str, Any] | None:
        return None if _same(current.get("sizing"), plan) else {"sizing": plan.to_status(now_rfc3339())}

    if await update_status(kube, svc.namespace, svc.name, change, seen=status) is not None:
        kopf.info(cast(kopf.Body, body), reason="InitialSizing", message=plan.event_message())
    if not plan.write:
        return svc
    return svc.model_copy(update={"spec": svc.spec.model_copy(update={"replicas": plan.replicas})})
