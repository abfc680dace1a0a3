"""The LLMService status derived from its Deployment. Pure: objects in, status dict out.

Ready is True only when every desired replica runs the current pod template and
passes readiness, and, with ``spec.router.enabled``, a router pod is ready too
(``status.endpoint`` then names the router, which must answer); Progressing while a rollout or scale is under way; Degraded when
the Deployment reports a failure (quota, a stuck rollout). Conditions go through
``set_condition`` so ``lastTransitionTime`` moves only on a real change. It does
not read metrics or decide replica counts (``operator/scaling`` does).
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.status import ConditionStatus, ConditionType, set_condition
from plimsoll.operator.resources.labels import selector_string
from plimsoll.operator.resources.router import router_endpoint_url
from plimsoll.operator.resources.service import endpoint_url


def _deployment_condition(deployment: dict[str, Any], type_: str) -> dict[str, Any] | None:
    conditions: list[dict[str, Any]] = deployment.get("status", {}).get("conditions", []) or []
    return next((c for c in conditions if c.get("type") == type_), None)


def _router_wait(svc: LLMService, router: dict[str, Any] | None) -> str:
    """Why the router keeps the endpoint from serving ("" when it does not): clients are sent to it."""
    if not svc.spec.router_in_front():
        return ""
    if router is None:
        return "the router Deployment does not exist yet"
    if int((router.get("status") or {}).get("readyReplicas", 0) or 0) < 1:
        # The router turns ready once it can take requests (a ready replica, or room to hold them).
        return "the router has no ready pod yet"
    return ""


def _counts(deployment: dict[str, Any] | None) -> dict[str, int]:
    status = (deployment or {}).get("status") or {}
    return {"replicas": int(status.get("replicas", 0) or 0), "readyReplicas": int(status.get("readyReplicas", 0) or 0)}


def _prefill_wait(svc: LLMService, prefill: dict[str, Any] | None) -> str:
    """Why a split service's prefill pool keeps it from serving well ("" when it does not)."""
    d = svc.spec.disaggregation
    if d is None:
        return ""
    desired = d.prefill.desired_replicas()
    ready = _counts(prefill)["readyReplicas"]
    if prefill is None:
        return "the prefill pool's Deployment does not exist yet"
    return f"prefill pool {ready}/{desired} ready" if ready < desired else ""


def _disaggregation_block(
    svc: LLMService, deployment: dict[str, Any] | None, prefill: dict[str, Any] | None, previous: dict[str, Any]
) -> dict[str, Any] | None:
    """``status.disaggregation``'s pool counts, merged into what other writers put there (None clears it)."""
    if svc.spec.disaggregation is None:
        return None
    block = dict(previous.get("disaggregation") or {})
    p, d = _counts(prefill), _counts(deployment)
    block["runs"] = "split"
    block["ratio"] = f"{p['replicas']}P:{d['replicas']}D"
    block["prefill"] = {**(block.get("prefill") or {}), **p}
    block["decode"] = {**(block.get("decode") or {}), **d}
    return block


def slo_status(svc: LLMService) -> dict[str, Any]:
    """``status.slo``: the objectives in force, and whether a preset supplied them."""
    slo = svc.spec.slo
    bounds = {"ttftP95Ms": slo.ttft_p95_ms, "tpotP50Ms": slo.tpot_p50_ms, "e2eP95Ms": slo.e2e_p95_ms}
    bounds = {k: v for k, v in bounds.items() if v is not None}
    said = ", ".join(f"{k} {v:g}" for k, v in bounds.items())
    if slo.defaulted_from is not None:
        source = f"preset:{slo.defaulted_from}"
        message = (
            f"spec.slo sets no objective, so the {slo.defaulted_from} preset applies ({said}): profiles, "
            "SLO attainment and alerts use it; set spec.slo (or slo.preset: none) to change it"
        )
    elif bounds:
        source, message = "spec", f"spec.slo: {said}"
    else:
        source, message = "none", "no latency objective (slo.preset: none)"
    return {**bounds, "source": source, "message": message}


def build_status(
    svc: LLMService,
    deployment: dict[str, Any] | None,
    previous: dict[str, Any],
    now: str | None = None,
    router: dict[str, Any] | None = None,
    prefill: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The status fields this layer owns (other fields, e.g. capacity, are left to their owners).

    ``previous`` is the object's current status (camelCase dict); its conditions
    are carried over so the ones other components set survive. ``router`` is the
    router's Deployment (None when it is disabled or not created yet); ``prefill`` the
    prefill pool's of a split service: Ready waits for it as for the router.
    """
    generation = svc.metadata.generation
    desired = svc.spec.desired_replicas()
    if svc.spec.variants:
        # The variants' Deployments added up (resources/variants.py): the planner sets each count.
        desired = int(((deployment or {}).get("spec") or {}).get("replicas", 0) or 0)
    dep_status: dict[str, Any] = (deployment or {}).get("status", {}) or {}
    dep_generation = (deployment or {}).get("metadata", {}).get("generation")
    observed = dep_status.get("observedGeneration")
    current = int(dep_status.get("replicas", 0) or 0)
    ready = int(dep_status.get("readyReplicas", 0) or 0)
    updated = int(dep_status.get("updatedReplicas", 0) or 0)
    rolled_out = deployment is not None and observed is not None and observed >= (dep_generation or 0)
    all_ready = rolled_out and ready >= desired and updated >= desired and current == updated

    conditions: list[dict[str, Any]] = list(previous.get("conditions", []) or [])
    router_wait = "; ".join(w for w in (_router_wait(svc, router), _prefill_wait(svc, prefill)) if w)

    def put(
        conds: list[dict[str, Any]], type_: ConditionType, status: ConditionStatus, reason: str, message: str
    ) -> list[dict[str, Any]]:
        return set_condition(conds, type_, status, reason, message, observed_generation=generation, now=now)

    if deployment is None:
        conditions = put(
            conditions, "Ready", "False", "DeploymentMissing", "the Deployment does not exist yet"
        )
        conditions = put(conditions, "Progressing", "True", "CreatingReplicas", "creating the Deployment")
    elif desired == 0:
        message = (
            "scaled to zero; the router holds requests and the first one brings a replica up"
            if svc.spec.router_in_front() else "replicas is 0; nothing serves"
        )
        conditions = put(conditions, "Ready", "False", "ScaledToZero", message)
        conditions = put(conditions, "Progressing", "False", "ScaledToZero", "no replicas requested")
    elif all_ready and not router_wait:
        conditions = put(conditions, "Ready", "True", "AllReplicasReady", f"{ready}/{desired} replicas ready")
        conditions = put(conditions, "Progressing", "False", "RolloutComplete", "all replicas updated")
    elif all_ready:
        message = f"{ready}/{desired} replicas ready; {router_wait}"
        reason = "RouterNotReady" if _router_wait(svc, router) else "PrefillPoolNotReady"
        conditions = put(conditions, "Ready", "False", reason, message)
        conditions = put(conditions, "Progressing", "True", reason, message)
    else:
        reason = "RollingOut" if rolled_out and updated < current else "ReplicasNotReady"
        message = f"{ready}/{desired} replicas ready, {updated} on the current spec"
        conditions = put(conditions, "Ready", "False", reason, message)
        conditions = put(conditions, "Progressing", "True", reason, message)

    failure = _deployment_condition(deployment or {}, "ReplicaFailure")
    stuck = _deployment_condition(deployment or {}, "Progressing")
    if failure is not None and failure.get("status") == "True":
        conditions = put(conditions, "Degraded", "True", "ReplicaFailure", str(failure.get("message", "")))
    elif stuck is not None and stuck.get("reason") == "ProgressDeadlineExceeded":
        conditions = put(
            conditions, "Degraded", "True", "ProgressDeadlineExceeded", str(stuck.get("message", ""))
        )
    else:
        conditions = put(conditions, "Degraded", "False", "AsExpected", "")

    out = {
        "observedGeneration": generation,
        "conditions": conditions,
        "replicas": current,
        "readyReplicas": ready,
        "selector": selector_string(svc),
        # With the router on, clients go through it: it balances LLM work, not connections.
        "endpoint": router_endpoint_url(svc) if svc.spec.router_in_front() else endpoint_url(svc),
        "slo": slo_status(svc),
    }
    split = _disaggregation_block(svc, deployment, prefill, previous)
    if split is not None or previous.get("disaggregation") is not None:
        out["disaggregation"] = split  # None clears the block of a service no longer split
    return out


def invalid_spec_status(
    generation: int | None, previous: dict[str, Any], message: str, now: str | None = None
) -> dict[str, Any]:
    """Status for a spec the API server accepted but the operator cannot serve."""
    conditions: list[dict[str, Any]] = list(previous.get("conditions", []) or [])

    def put(
        conds: list[dict[str, Any]], type_: ConditionType, status: ConditionStatus, reason: str, message: str
    ) -> list[dict[str, Any]]:
        return set_condition(conds, type_, status, reason, message, observed_generation=generation, now=now)

    conditions = put(conditions, "Ready", "False", "InvalidSpec", message)
    conditions = put(conditions, "Degraded", "True", "InvalidSpec", message)
    conditions = put(conditions, "Progressing", "False", "InvalidSpec", "fix the spec to continue")
    return {"observedGeneration": generation, "conditions": conditions}
