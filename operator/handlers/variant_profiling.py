"""Capacity profiling per hardware variant: the same benchmark Job on a replica of each variant.

What it is: :func:`profile_variants`, the profiling timer's step for a service
with ``spec.variants``. Each variant is profiled as a single-shape service is
(``profiling.py``, decided by ``profile_plan.decide``), on the service as that
variant sees it (``resources/variants.py``): its own spec hash (its accelerator,
node selector and engine arguments are in it), its own Job (labelled
``plimsoll.dev/variant``) measuring a Ready replica of that variant on the
current pod template, verified by the same hold, its result in
``status.variants.<name>.capacity`` with the request rate one replica carries
there. A variant profile goes stale on its own (``ProfileStale``) and is
measured again on its own: ``plimsoll.dev/reprofile`` naming ``variant=<name>``
(as the drift check writes it) re-profiles that variant, without a name every
variant. ``Profiled`` and ``ProfileStale`` sum the variants up (True only when
every variant is profiled; stale when any is), each variant's own verdict in
``status.variants.<name>.profile``.

What it is not: the rules (``profiling.py``'s docstring) or the Job builder.
"""

import re
from typing import Any

import kopf

from plimsoll.operator.api.base import API_VERSION, KIND
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import ConditionUpdate
from plimsoll.operator.handlers.handler_types import Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.profiling import (
    _view,
    current_replica_ip,
    list_profile_jobs,
    record_job,
    start_job,
)
from plimsoll.operator.handlers.status_writer import MAX_MESSAGE, update_status, with_conditions
from plimsoll.operator.handlers.variant_status import profile_state
from plimsoll.operator.resources.engine import engine_image
from plimsoll.operator.resources.labels import selector_string
from plimsoll.operator.resources.profile_job import ProfileArgsError
from plimsoll.operator.resources.settings import BuildSettings
from plimsoll.operator.resources.variants import VARIANT_LABEL, variant_service
from plimsoll.operator.scaling.inputs import spec_profile_hash
from plimsoll.operator.scaling.profile_plan import REPROFILE_ANNOTATION, decide

_NAMED = re.compile(r"variant=([a-z0-9]([-a-z0-9]*[a-z0-9])?)")


def requested_variants(svc: LLMService) -> set[str]:
    """The variants ``plimsoll.dev/reprofile`` asks for: those it names (``variant=<name>``), else all."""
    value = svc.metadata.annotations.get(REPROFILE_ANNOTATION)
    if value is None:
        return set()
    named = {m.group(1) for m in _NAMED.finditer(value)}
    return named or {v.name for v in svc.spec.variants}


def _label(obj: dict[str, Any]) -> str | None:
    return (obj["metadata"].get("labels") or {}).get(VARIANT_LABEL)


def summed_conditions(
    svc: LLMService, profiles: dict[str, dict[str, Any]], status: dict[str, Any]
) -> tuple[ConditionUpdate, ...]:
    """``Profiled`` (every variant) and ``ProfileStale`` (any variant) from each variant's verdict."""
    names = [v.name for v in svc.spec.variants]
    capacities = {n: ((status.get("variants") or {}).get(n) or {}).get("capacity") or {} for n in names}
    waiting = [n for n in names if profiles[n].get("profiled") != "True"]
    if not waiting:
        each = "; ".join(
            f"{n}: {capacities[n].get('concurrencyPerReplica')} in flight per replica"
            + (f", {capacities[n]['requestsPerSecondPerReplica']:g} requests/s" if capacities[n].get("requestsPerSecondPerReplica") else "")
            for n in names
        )  # fmt: skip
        profiled: ConditionUpdate = ("Profiled", "True", "AllVariantsProfiled", each[:MAX_MESSAGE])
    else:
        first = profiles[waiting[0]]
        each = "; ".join(
            f"{n}: {profiles[n].get('reason', 'Unknown')}: {profiles[n].get('message', '')}" for n in waiting
        )
        profiled = ("Profiled", "False", str(first.get("reason") or "Profiling"), each[:MAX_MESSAGE])
    stale_names = [n for n in names if profiles[n].get("stale") == "True"]
    if stale_names:
        text = "; ".join(f"{n}: {profiles[n].get('staleMessage', '')}" for n in stale_names)
        stale: ConditionUpdate = ("ProfileStale", "True", "SpecChanged", text[:MAX_MESSAGE])
    else:
        stale = ("ProfileStale", "False", "ProfileCurrent" if not waiting else "NotProfiled",
                 "every variant's profile was measured on its current spec" if not waiting
                 else f"not measured yet: {', '.join(waiting)}")  # fmt: skip
    return profiled, stale


async def profile_variants(
    kube: Kube, body: kopf.Body, svc: LLMService, settings: BuildSettings, logger: Log
) -> None:
    """One pass over every variant: observe, decide, act; then the summed conditions (module docstring)."""
    status = dict(body.get("status") or {})
    jobs = await list_profile_jobs(kube, svc)
    pods = await kube.list_objects("v1", "Pod", svc.namespace, label_selector=selector_string(svc))
    requested = requested_variants(svc)
    verdicts: dict[str, tuple[ConditionUpdate, ...]] = {}
    cleared = []
    for variant in svc.spec.variants:
        name = variant.name
        view = variant_service(svc, variant)
        if name not in requested and REPROFILE_ANNOTATION in view.metadata.annotations:
            others = {k: v for k, v in view.metadata.annotations.items() if k != REPROFILE_ANNOTATION}
            view = view.model_copy(
                update={"metadata": view.metadata.model_copy(update={"annotations": others})}
            )
        current_hash = spec_profile_hash(view.spec, engine_image(view, settings))
        stored = ((status.get("variants") or {}).get(name) or {}).get("capacity") or {}
        mine = {n: j for n, j in jobs.items() if _label(j) == name}
        pod_ip = current_replica_ip(view, settings, [p for p in pods if _label(p) == name])
        plan = decide(
            view, current_hash, stored.get("specHash"), [_view(j) for j in mine.values()], pod_ip is not None
        )
        for job in plan.delete:
            await kube.delete("batch/v1", "Job", svc.namespace, job)
            logger.info("deleted profile Job %s of variant %s (obsolete)", job, name)
        verdicts[name] = plan.conditions
        if plan.start is not None and pod_ip is not None:
            try:
                await start_job(kube, body, view, settings, current_hash, pod_ip, f"variant {name}: {plan.start}",
                                variant=name)  # fmt: skip
            except ProfileArgsError as error:
                verdicts[name] = (("Profiled", "False", "InvalidProfileArgs", str(error)),)
        if plan.record is not None:
            await record_job(kube, body, view, mine[plan.record], logger, variant=name)
        if name in requested and plan.clear_annotation:
            cleared.append(name)
    if requested and set(cleared) >= requested:
        await kube.merge_patch(API_VERSION, KIND, svc.namespace, svc.name,
                               {"metadata": {"annotations": {REPROFILE_ANNOTATION: None}}})  # fmt: skip

    def change(current: dict[str, Any]) -> dict[str, Any] | None:
        stored = current.get("variants") or {}
        profiles = {
            v.name: profile_state(verdicts.get(v.name, ()), (stored.get(v.name) or {}).get("profile") or {})
            for v in svc.spec.variants
        }
        moved = {n: {"profile": p} for n, p in profiles.items() if (stored.get(n) or {}).get("profile") != p}
        conditions = with_conditions(current.get("conditions"), summed_conditions(svc, profiles, current),
                                     svc.metadata.generation)  # fmt: skip
        if not moved and conditions == current.get("conditions"):
            return None
        return {"variants": moved, "conditions": conditions} if moved else {"conditions": conditions}

    written = await update_status(kube, svc.namespace, svc.name, change)
    if written is not None:
        before = written.condition_before("ProfileStale") or {}
        after: dict[str, Any] = next(
            (c for c in written.patch.get("conditions", []) if c.get("type") == "ProfileStale"), {}
        )
        if after.get("status") == "True" and before.get("status") != "True":
            kopf.info(body, reason="ProfileStale", message=str(after.get("message", "")))
