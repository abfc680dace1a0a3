"""Profiling a split LLMService: each pool measured by its own benchmark Job, for its own knee.

What it is: :func:`profile_pools`, what the profiling timer runs for a service with
``spec.disaggregation``. Each pool goes through the same steps as a service's one profile
(``profiling.py``: ``profile_plan.decide`` on what exists, a Job against one Ready replica of the
pool's current spec, the report recorded once), with the pool's own workload and SLO
(``resources/pools.py``'s ``profile_view``): the prefill pool's sweep sends long prompts for one
token and reads **prompt tokens per second at the TTFT SLO**; the decode pool's sends short prompts
for long outputs and reads **sequences per replica at the TPOT SLO** (⌊headroom × knee⌋) and their
TPOT. Each lands in ``status.disaggregation.<pool>.profile`` with the spec hash it measured;
``Profiled`` is True once both pools hold a profile of their current spec, and says both figures.
Jobs carry the pool's ``plimsoll.dev/role`` label, so each pool sees only its own.

What it is not: the scaling that reads the figures (``operator/scaling/pools.py``) or the Job builder.
"""

from __future__ import annotations

from typing import Any

import kopf

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import ConditionUpdate
from plimsoll.operator.handlers.handler_types import Log
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.handlers.ownership import (
    OWNERSHIP_CONDITION,
    OwnershipConflict,
    conflict_message,
    delete_owned,
)
from plimsoll.operator.handlers.profiling import (
    RECORDED_ANNOTATION,
    _job_state,
    _view,
    current_replica_ip,
    list_profile_jobs,
    patch_profile_status,
    start_job,
)
from plimsoll.operator.handlers.status_writer import MAX_MESSAGE, update_status
from plimsoll.operator.resources.engine import engine_image
from plimsoll.operator.resources.labels import selector_string
from plimsoll.operator.resources.pool_view import ROLE_LABEL, Role
from plimsoll.operator.resources.pools import prefill_selector, profile_view
from plimsoll.operator.resources.profile_job import (
    REPORT_KEY,
    SPEC_HASH_ANNOTATION,
    ProfileArgsError,
)
from plimsoll.operator.resources.settings import BuildSettings
from plimsoll.operator.scaling.inputs import spec_profile_hash
from plimsoll.operator.scaling.profile import CapacityProfile, read_profile
from plimsoll.operator.scaling.profile_plan import Plan, decide

ROLES: tuple[Role, ...] = ("prefill", "decode")


def pool_figures(
    role: Role, profile: CapacityProfile, input_tokens: int, output_tokens: int
) -> dict[str, Any]:
    """What a pool's profile says for its scaling: prefill tokens/s, or decode sequences and their TPOT (pure).

    Both at the report's recommended concurrency (⌊headroom × the knee⌋), from the highest measured level
    not above it.
    """
    rec = profile.concurrency_per_replica
    below = [lv for lv in profile.levels if lv.concurrency <= rec] or list(profile.levels[:1])
    level = max(below, key=lambda lv: lv.concurrency) if below else None
    figures: dict[str, Any] = {"concurrencyPerReplica": rec, "knees": profile.knees(),
                               "inputTokens": input_tokens, "outputTokens": output_tokens}  # fmt: skip
    if level is None or not level.output_tokens_per_s:
        return figures
    requests_per_s = level.output_tokens_per_s / output_tokens
    if role == "prefill":
        figures["promptTokensPerSecond"] = round(requests_per_s * input_tokens, 1)
    else:
        figures["sequencesPerReplica"] = rec
        figures["tpotSeconds"] = level.tpot_p50_ms / 1e3 if level.tpot_p50_ms else None
    figures["atConcurrency"] = level.concurrency
    return figures


async def _pool_pods(kube: Kube, svc: LLMService, role: Role) -> list[dict[str, Any]]:
    selector = prefill_selector(svc) if role == "prefill" else selector_string(svc)
    pods: list[dict[str, Any]] = await kube.list_objects("v1", "Pod", svc.namespace, label_selector=selector)
    return pods


async def _write_profile(kube: Kube, svc: LLMService, role: Role, profile: dict[str, Any]) -> None:
    def change(status: dict[str, Any]) -> dict[str, Any]:
        block = dict(status.get("disaggregation") or {})
        block[role] = {**(block.get(role) or {}), "profile": profile}
        return {"disaggregation": block}

    await update_status(kube, svc.namespace, svc.name, change)


async def _record(
    kube: Kube, body: kopf.Body, svc: LLMService, role: Role, job: dict[str, Any], logger: Log
) -> dict[str, Any] | ConditionUpdate:
    """A finished Job of pool ``role``: its figures (written to status), or the Profiled=False it earns."""
    ns, name = svc.namespace, job["metadata"]["name"]
    view = profile_view(svc, role)
    workload = view.spec.capacity.profile.workload
    outcome: dict[str, Any] | ConditionUpdate
    if _job_state(job) == "Failed":
        outcome = ("Profiled", "False", "ProfileJobFailed", f"{role} pool: benchmark Job {name} failed")
    else:
        cm = await kube.get("v1", "ConfigMap", ns, name) or {}
        report = (cm.get("data") or {}).get(REPORT_KEY)
        parsed = read_profile(report) if report is not None else None
        if isinstance(parsed, CapacityProfile):
            outcome = {
                **pool_figures(role, parsed, workload.input_tokens, workload.output_tokens),
                "specHash": job["metadata"]["annotations"][SPEC_HASH_ANNOTATION],
                "measuredAt": (job.get("status") or {}).get("completionTime"),
            }
            await _write_profile(kube, svc, role, outcome)
            kopf.info(
                body, reason="Profiled", message=f"{role} pool: {describe(role, outcome)}"[:MAX_MESSAGE]
            )
            logger.info("%s pool profiled: %s", role, describe(role, outcome))
        else:
            why = "no report" if parsed is None else f"{parsed.reason}: {parsed.message}"
            outcome = ("Profiled", "False", "ProfileFailed", f"{role} pool: benchmark Job {name}: {why}")
    if isinstance(outcome, tuple):
        kopf.warn(body, reason="ProfileFailed", message=outcome[3][:MAX_MESSAGE])
    await kube.merge_patch(
        "batch/v1", "Job", ns, name, {"metadata": {"annotations": {RECORDED_ANNOTATION: "true"}}}
    )
    return outcome


def describe(role: Role, profile: dict[str, Any]) -> str:
    if role == "prefill":
        rate = profile.get("promptTokensPerSecond")
        return (
            f"{rate:,.0f} prompt tokens/s at the TTFT SLO (c={profile.get('atConcurrency')})"
            if rate
            else "no rate"
        )
    tpot = profile.get("tpotSeconds")
    return (f"{profile.get('sequencesPerReplica')} sequences per replica at the TPOT SLO"
            + (f" (TPOT {tpot * 1e3:.0f} ms)" if tpot else ""))  # fmt: skip


async def _step(
    kube: Kube, body: kopf.Body, svc: LLMService, settings: BuildSettings, role: Role,
    jobs: dict[str, dict[str, Any]], logger: Log,
) -> tuple[Plan, dict[str, Any] | ConditionUpdate | None, str]:  # fmt: skip
    """One pool's profiling step: (the plan, what a recorded Job gave, the pool's current spec hash)."""
    view = profile_view(svc, role)
    current = spec_profile_hash(view.spec, engine_image(view, settings))
    stored = (((body.get("status") or {}).get("disaggregation") or {}).get(role) or {}).get("profile") or {}
    mine = {n: j for n, j in jobs.items() if (j["metadata"].get("labels") or {}).get(ROLE_LABEL) == role}
    pod_ip = current_replica_ip(svc, settings, await _pool_pods(kube, svc, role), role)
    plan = decide(
        view, current, stored.get("specHash"), [_view(j) for j in mine.values()], pod_ip is not None
    )
    for name in plan.delete:
        await delete_owned(kube, body, "batch/v1", "Job", svc.namespace, name)
    recorded: dict[str, Any] | ConditionUpdate | None = None
    if plan.start is not None and pod_ip is not None:
        # One account profiles both pools: the Role must keep the other pool's running Job able to
        # write its report (a Role naming only this Job's ConfigMap would lock that one out).
        others = [n for n, j in jobs.items() if n not in plan.delete and _job_state(j) == "Running"]
        job = await start_job(
            kube, body, view, settings, current, pod_ip, plan.start, role=role, running=others
        )
        jobs[job["metadata"]["name"]] = job  # the other pool's step, later in this pass, keeps it in its Role
    if plan.record is not None:
        recorded = await _record(kube, body, svc, role, mine[plan.record], logger)
    return plan, recorded, current


async def profile_pools(
    kube: Kube, body: kopf.Body, svc: LLMService, settings: BuildSettings, logger: Log
) -> Plan:
    """Both pools' steps, then ``Profiled`` and ``ProfileStale`` for the service as a whole."""
    jobs = await list_profile_jobs(kube, svc)
    stored = (body.get("status") or {}).get("disaggregation") or {}
    profiled: list[str] = []
    waiting: list[tuple[Role, ConditionUpdate]] = []
    stale: list[str] = []
    last = Plan()
    for role in ROLES:
        try:
            plan, recorded, current = await _step(kube, body, svc, settings, role, jobs, logger)
        except ProfileArgsError as error:
            await patch_profile_status(kube, svc, (("Profiled", "False", "InvalidProfileArgs", str(error)),))
            return Plan()
        except OwnershipConflict as conflict:
            # A profile object's name belongs to another owner: say so, touch nothing of it.
            message = f"{role} pool: {conflict_message([conflict.label])}"
            if await patch_profile_status(kube, svc, (("Profiled", "False", OWNERSHIP_CONDITION, message),)):
                kopf.warn(body, reason=OWNERSHIP_CONDITION, message=message[:MAX_MESSAGE])
            return Plan()
        last = plan
        profile = recorded if isinstance(recorded, dict) else ((stored.get(role) or {}).get("profile") or {})
        if isinstance(recorded, tuple):
            waiting.append((role, recorded))
        elif profile.get("specHash") == current:
            profiled.append(f"{role}: {describe(role, profile)}")
        else:
            if profile.get("specHash"):
                stale.append(
                    f"the {role} pool's profile measured spec {profile['specHash']}, it is now {current}"
                )
            cond = next((c for c in plan.conditions if c[0] == "Profiled"), None)
            waiting.append((role, cond or ("Profiled", "False", "Profiling", "waiting for its profile")))
    conditions: list[ConditionUpdate] = []
    if not waiting:
        conditions.append(("Profiled", "True", "PoolsProfiled", "; ".join(profiled)))
    else:
        role, (_, _, reason, message) = waiting[0]
        named = message if message.startswith(f"{role} pool") else f"{role} pool: {message}"
        conditions.append(("Profiled", "False", reason, named))
    conditions.append(("ProfileStale", "True", "SpecChanged", "; ".join(stale)) if stale
                      else ("ProfileStale", "False", "ProfileCurrent", "each pool's profile measured its current spec"))  # fmt: skip
    await patch_profile_status(kube, svc, tuple(conditions))
    return last
