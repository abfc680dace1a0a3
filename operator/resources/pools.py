"""The prefill pool's Deployment of a split LLMService. Pure.

What it is: :func:`build_prefill_deployment`: ``<name>-prefill``, selected by the ``prefill``
component (so it never shares pods with the service's own Deployment, which is the decode pool),
its pods labelled ``plimsoll.dev/role: prefill`` for the router and built from the prefill pool's
view (``pool_view.py``: its resources, engine arguments and ``kv_producer`` transfer flag), with
the KV transfer port declared as ``kv``; and :func:`profile_view`, what each pool's profile Job
measures. What it is not: the decode pool (``deployment.py`` builds it from the decode view) or
the applying.
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.api.spec import ProfileSpec, ProfileWorkload
from plimsoll.operator.resources.deployment import replica_pod_template
from plimsoll.operator.resources.engine import ENGINE_CONTAINER
from plimsoll.operator.resources.labels import common_labels, selector_labels
from plimsoll.operator.resources.pool_view import ROLE_LABEL, Role, pool_view
from plimsoll.operator.resources.settings import BuildSettings

PREFILL_COMPONENT = "prefill"


def prefill_name(svc: LLMService) -> str:
    return f"{svc.name}-prefill"


def prefill_selector(svc: LLMService) -> str:
    """The prefill pool's pods as a label selector."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(svc, PREFILL_COMPONENT).items()))


def build_prefill_deployment(svc: LLMService, settings: BuildSettings) -> dict[str, Any]:
    d = svc.spec.disaggregation
    assert d is not None, "only a split service has a prefill pool"
    template = replica_pod_template(svc, settings, role="prefill", component=PREFILL_COMPONENT)
    for container in template["spec"]["containers"]:
        if container["name"] == ENGINE_CONTAINER:
            container["ports"].append({"name": "kv", "containerPort": d.kv_port, "protocol": "TCP"})
    labels = {**common_labels(svc, PREFILL_COMPONENT), ROLE_LABEL: "prefill"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": prefill_name(svc), "namespace": svc.namespace, "labels": labels},
        "spec": {
            "replicas": d.prefill.desired_replicas(),
            "selector": {"matchLabels": selector_labels(svc, PREFILL_COMPONENT)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": template,
        },
    }


def profile_view(svc: LLMService, role: Role) -> LLMService:
    """The service as pool ``role``'s profile Job measures it: the pool's view, its workload, and only the
    SLO its knee is about (prefill: TTFT; decode: TPOT)."""
    d = svc.spec.disaggregation
    assert d is not None
    w = (d.prefill if role == "prefill" else d.decode).profile
    view = pool_view(svc, role)
    spec = view.spec
    # The pool's shape and levels; the floor on each level's time stays the service's
    # (capacity.profile.workload.minSecondsPerLevel), so one knob makes every profile quick or thorough.
    workload = ProfileWorkload(input_tokens=w.input_tokens, output_tokens=w.output_tokens,
                               concurrency=list(w.concurrency), requests_per_level=w.requests_per_level,
                               min_seconds_per_level=spec.capacity.profile.workload.min_seconds_per_level)  # fmt: skip
    keep = "ttft_p95_ms" if role == "prefill" else "tpot_p50_ms"
    slo = spec.slo.model_copy(
        update={k: None for k in ("ttft_p95_ms", "tpot_p50_ms", "e2e_p95_ms") if k != keep}
    )
    capacity = spec.capacity.model_copy(update={"profile": ProfileSpec(workload=workload)})
    return view.model_copy(update={"spec": spec.model_copy(update={"slo": slo, "capacity": capacity})})
