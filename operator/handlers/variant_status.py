"""One hardware variant's profiling verdict and capacity, written into ``status.variants.<name>``.

What it is: :func:`record_variant_profile`, the write a variant's profile step
makes instead of the service's ``Profiled`` / ``ProfileStale`` conditions and
``status.capacity``: the capacity measured for that variant (when one was) and
where its profiling stands (``profile``: the Profiled verdict, and whether the
profile is stale), merged into the freshest status and written only when it
changes. ``variant_profiling.py`` sums the variants up into the conditions.

What it is not: the profiling decision (``profile_plan.py``) or the Job.
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import ConditionUpdate
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.status_writer import MAX_MESSAGE, update_status


def profile_state(conditions: tuple[ConditionUpdate, ...], stored: dict[str, Any]) -> dict[str, Any]:
    """``status.variants.<name>.profile`` after these Profiled / ProfileStale verdicts (others kept)."""
    state = dict(stored)
    for type_, status, reason, message in conditions:
        if type_ == "Profiled":
            state.update({"profiled": status, "reason": reason, "message": message[:MAX_MESSAGE]})
        elif type_ == "ProfileStale":
            state.update({"stale": status, "staleReason": reason, "staleMessage": message[:MAX_MESSAGE]})
    return state


async def record_variant_profile(
    kube: Kube,
    svc: LLMService,
    variant: str,
    conditions: tuple[ConditionUpdate, ...],
    capacity: dict[str, Any] | None = None,
) -> bool:
    """Merge one variant's verdicts (and capacity) into status; True when something changed."""

    def change(status: dict[str, Any]) -> dict[str, Any] | None:
        stored = (status.get("variants") or {}).get(variant) or {}
        entry: dict[str, Any] = {"profile": profile_state(conditions, stored.get("profile") or {})}
        if capacity is not None:
            entry["capacity"] = capacity
        if all(stored.get(k) == v for k, v in entry.items()):
            return None
        return {"variants": {variant: entry}}

    return await update_status(kube, svc.namespace, svc.name, change) is not None
