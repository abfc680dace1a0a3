"""Report an hf:// model's download in the LLMService: the ModelReady condition and Events.

Reads the replica pods' ``fetch-model`` init containers (``resources/model_fetch.py``
names what their exit codes and termination messages mean), sets ``ModelReady`` on
the freshest copy of the status (``status_writer.py``), and posts a Warning Event when a download fails for
a new reason. It does not retry anything: the kubelet's restart back-off does.
"""

import logging
from typing import Any, cast

import kopf

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.model_uri import parse_model_uri
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.pods import list_pods
from plimsoll.operator.handlers.status_writer import set_conditions
from plimsoll.operator.resources.model_fetch import fetch_condition


async def report_model_download(
    kube: Kube,
    body: kopf.Body | dict[str, Any],
    svc: LLMService,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:
    """Set ModelReady from the fetch init containers (hf:// models only)."""
    if parse_model_uri(svc.spec.model.uri).scheme != "hf":
        return
    condition = fetch_condition(await list_pods(kube, svc))
    if condition is None:
        return
    conditions = (body.get("status") or {}).get("conditions") or []
    before: dict[str, Any] = next((c for c in conditions if c.get("type") == "ModelReady"), {})
    changed = await set_conditions(
        kube,
        svc.namespace,
        svc.name,
        (("ModelReady", condition.status, condition.reason, condition.message),),
        svc.metadata.generation,
    )
    if changed and condition.status == "False" and before.get("reason") != condition.reason:
        logger.warning("model download failed: %s", condition.message)
        kopf.warn(cast(kopf.Body, body), reason=condition.reason, message=condition.message)
    elif changed and condition.status == "True" and before.get("status") != "True":
        kopf.info(cast(kopf.Body, body), reason="ModelDownloaded", message=condition.message)
