"""``kubectl annotate llms NAME plimsoll.dev/profile=20s``: profile one Ready replica and say where it is.

What it is: a kopf timer that runs only while an LLMService carries the
``plimsoll.dev/profile`` annotation (kopf's own annotations share the
``plimsoll.dev/`` prefix and are left out of its change detection, so an update
handler would never see this one). One pass: read the request
(``resources/runtime_profile.py``), pick a Ready replica, ``POST /debug/profile``
to it (``plimsoll.profile_fetch.take_profile``, the same call as `plimsoll
profile`), store the gzip result in a ConfigMap when it fits or point at the
replica's own copy on its volume when it does not, write ``status.lastProfile``
(pod, kind, seconds, where, when, the kubectl command that fetches it) through
``status_writer.py``, post an Event and remove the annotations. A request that
cannot be served (a bad duration, profiling off, the replica refusing) gets a
Warning Event and ``status.lastProfile.error``, and its annotation is removed
too: annotate again to retry. With no Ready replica the pass waits (next tick).
What it is not: capacity profiling (``profiling.py``: benchmark Jobs, the
``Profiled`` condition), nor the endpoint itself. Importing this module
registers the timer.
"""

import asyncio
import gzip
import os
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import ValidationError

from plimsoll.operator.api.base import API_VERSION, GROUP, KIND, PLURAL, VERSION
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.credentials import admin_key
from plimsoll.operator.handlers.handler_types import Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.ownership import OwnershipConflict, conflict_message, existing_owned
from plimsoll.operator.handlers.status_writer import update_status
from plimsoll.operator.resources.labels import selector_string
from plimsoll.operator.resources.runtime_profile import (
    PROFILE_ANNOTATION,
    PROFILE_KIND_ANNOTATION,
    ProfileRequestError,
    build_profile_configmap,
    configmap_fetch_command,
    configmap_name,
    fits_configmap,
    pod_fetch_command,
    profile_key,
    profile_request,
    ready_replica,
)
from plimsoll.operator.resources.settings import ENGINE_PORT
from plimsoll.profile_fetch import MAX_PROFILE_BYTES, ProfileError, take_profile

INTERVAL_S = float(os.environ.get("PLIMSOLL_RUNTIME_PROFILE_INTERVAL_SECONDS", "2"))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _write_last_profile(kube: Kube, svc: LLMService, last: dict[str, Any]) -> bool:
    def change(status: dict[str, Any]) -> dict[str, Any] | None:
        return None if status.get("lastProfile") == last else {"lastProfile": last}

    return await update_status(kube, svc.namespace, svc.name, change) is not None


async def _done(kube: Kube, svc: LLMService) -> None:
    """Remove the request: one annotation, one profile."""
    patch = {"metadata": {"annotations": {PROFILE_ANNOTATION: None, PROFILE_KIND_ANNOTATION: None}}}
    await kube.merge_patch(API_VERSION, KIND, svc.namespace, svc.name, patch)


async def _refuse(kube: Kube, body: kopf.Body, svc: LLMService, message: str, **fields: Any) -> None:
    await _write_last_profile(kube, svc, {**fields, "error": message, "time": _now()})
    kopf.warn(body, reason="RuntimeProfileFailed", message=message)
    await _done(kube, svc)


async def profile_replica(kube: Kube, body: kopf.Body, logger: Log) -> dict[str, Any] | None:
    """One pass of the annotation flow; returns the ``lastProfile`` written (None while waiting)."""
    meta = body["metadata"]
    # The freshest copy: a tick that raced the removal of a served request must not serve it twice.
    fresh = await kube.get(API_VERSION, KIND, meta["namespace"], meta["name"])
    if fresh is None or PROFILE_ANNOTATION not in (fresh["metadata"].get("annotations") or {}):
        return None
    svc = LLMService.from_body(fresh)
    try:
        request = profile_request(svc)
    except ProfileRequestError as error:
        await _refuse(kube, body, svc, str(error))
        return None
    pods = await kube.list_objects("v1", "Pod", svc.namespace, label_selector=selector_string(svc))
    pod = ready_replica(pods)
    if pod is None:
        logger.debug("runtime profile requested; waiting for a Ready replica")
        return None
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
    base = {"pod": name, "kind": request.kind, "seconds": request.seconds}
    admin = await admin_key(kube, svc)  # /debug/profile is a control endpoint
    logger.info("profiling pod %s for %gs (%s)", name, request.seconds, request.kind)
    try:
        profile = await take_profile(f"http://{ip}:{ENGINE_PORT}", request.seconds, request.kind, admin,
                                     max_bytes=MAX_PROFILE_BYTES)  # fmt: skip
    except ProfileError as error:
        await _refuse(kube, body, svc, f"pod {name}: {error}", **base)
        return None
    # Compressing tens of MiB takes a while: off the event loop every LLMService's handlers share.
    compressed = await asyncio.to_thread(gzip.compress, profile.data, 6)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    last: dict[str, Any] = {**base, "bytes": len(compressed), "time": _now()}
    if fits_configmap(compressed):
        key = profile_key(request.kind, stamp)
        configmap = build_profile_configmap(svc, key, compressed, name)
        kopf.adopt(configmap, owner=body)
        try:
            # Replaced whole, so the previous profile's key goes with it; never someone else's ConfigMap.
            if await existing_owned(kube, body, configmap) is not None:
                await kube.delete("v1", "ConfigMap", svc.namespace, configmap_name(svc))
        except OwnershipConflict as conflict:
            await _refuse(kube, body, svc, conflict_message([conflict.label]), **base)
            return None
        await kube.create(configmap)
        last.update(configMap=configmap_name(svc), key=key, fetch=configmap_fetch_command(svc, key))
        where = f"ConfigMap {configmap_name(svc)} key {key}"
    elif profile.server_path:
        last.update(path=profile.server_path, fetch=pod_fetch_command(svc, name, profile.server_path))
        where = (
            f"{profile.server_path} on pod {name} ({len(compressed)} bytes gzip, too large for a ConfigMap)"
        )
    else:
        await _refuse(kube, body, svc, f"pod {name}: the profile is too large for a ConfigMap and the "
                      "replica did not say where it kept its copy", **base)  # fmt: skip
        return None
    await _write_last_profile(kube, svc, last)
    kopf.info(body, reason="RuntimeProfiled", message=f"{request.kind} profile of {name} "
              f"({request.seconds:g} s) in {where}; fetch: {last['fetch']}")  # fmt: skip
    await _done(kube, svc)
    return last


@kopf.timer(GROUP, VERSION, PLURAL, interval=INTERVAL_S, annotations={PROFILE_ANNOTATION: kopf.PRESENT})
async def profile_on_annotation(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Serve a ``plimsoll.dev/profile`` request (see the module docstring)."""
    if body.get("metadata", {}).get("deletionTimestamp"):
        return
    try:
        await profile_replica(memo.kube, body, logger)
    except ValidationError:
        return  # reported by reconcile as InvalidSpec
    except ApiException as error:
        if error.status == 404:
            return
        logger.warning("runtime profile pass failed: %s %s", error.status, error.reason)
