"""Report an hf:// model's download in the LLMService: the ModelReady and ModelCached conditions and Events.

Reads the replica pods' ``fetch-model`` init containers (``resources/model_fetch.py``
names what their exit codes and termination messages mean) and, with ``model.cache.prefill``,
the node-cache DaemonSet (``resources/model_cache.py``), sets ``ModelReady`` (and ``ModelCached``) on
the freshest copy of the status (``status_writer.py``), and posts a Warning Event when a download fails for
a new reason. It does not retry anything: the kubelet's restart back-off does.
"""

from typing import Any, cast

import kopf

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.model_uri import parse_model_uri
from plimsoll.operator.api.status import ConditionType
from plimsoll.operator.handlers.handler_types import BodyLike, Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.pods import list_pods
from plimsoll.operator.handlers.status_writer import set_conditions
from plimsoll.operator.resources.labels import selector_labels
from plimsoll.operator.resources.model_cache import (
    COMPONENT,
    cache_condition,
    model_cache_name,
    wants_prefill,
)
from plimsoll.operator.resources.model_fetch import FetchCondition, fetch_condition


async def report_model_download(kube: Kube, body: BodyLike, svc: LLMService, logger: Log) -> None:
    """Set ModelReady from the fetch init containers (hf:// models only), and ModelCached with prefill."""
    if parse_model_uri(svc.spec.model.uri).scheme != "hf":
        return
    if wants_prefill(svc):
        daemonset = await kube.get("apps/v1", "DaemonSet", svc.namespace, model_cache_name(svc))
        selector = ",".join(f"{k}={v}" for k, v in sorted(selector_labels(svc, COMPONENT).items()))
        fill_pods = await kube.list_objects("v1", "Pod", svc.namespace, label_selector=selector)
        cached = cache_condition(daemonset, fill_pods)
        if cached is not None:
            await _report(kube, body, svc, "ModelCached", cached, logger)
    condition = fetch_condition(await list_pods(kube, svc))
    if condition is None:
        return
    await _report(kube, body, svc, "ModelReady", condition, logger)


async def _report(
    kube: Kube,
    body: BodyLike,
    svc: LLMService,
    kind: ConditionType,
    condition: FetchCondition,
    logger: Log,
) -> None:
    conditions = (body.get("status") or {}).get("conditions") or []
    before: dict[str, Any] = next((c for c in conditions if c.get("type") == kind), {})
    changed = await set_conditions(
        kube,
        svc.namespace,
        svc.name,
        ((kind, condition.status, condition.reason, condition.message),),
        svc.metadata.generation,
    )
    if changed and condition.status == "False" and before.get("reason") != condition.reason:
        logger.warning("%s: %s", kind, condition.message)
        kopf.warn(cast(kopf.Body, body), reason=condition.reason, message=condition.message)
    elif changed and condition.status == "True" and before.get("status") != "True":
        reason = "ModelDownloaded" if kind == "ModelReady" else "ModelCached"
        kopf.info(cast(kopf.Body, body), reason=reason, message=condition.message)
