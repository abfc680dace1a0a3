"""Helpers for driving the replica planner as its handler does, without a cluster.

A :class:`Service` holds the spec and the status as the API server would store
them; :meth:`Service.tick` asks the planner for a plan and applies it the way
``handlers/replica_planning.py`` does (each changed count into the spec, the
status fields merged, conditions through the one condition helper), so a test
reads the same status a user would.
"""

from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.api.spec import LLMServiceSpec
from plimsoll.operator.api.status import set_condition
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import Observations, PodObservation, RouterDemand
from plimsoll.operator.scaling.planner import ReplicaPlanner
from plimsoll.operator.scaling.replica_plan import Plan


def sample(running: float = 0.0, waiting: float = 0.0, cut: float | None = None) -> PodSample:
    return PodSample(
        engine="plimsoll",
        running=running,
        waiting=waiting,
        kv_usage=None,
        ttft=None,
        tpot=None,
        requests_cut=cut,
    )


def pod(name: str, running: float = 0.0, waiting: float = 0.0, **kw: Any) -> PodObservation:
    """A Ready pod with a scrape (``ready=False`` / ``sample=None`` / ``draining`` / ``terminating`` as given)."""
    ready = kw.pop("ready", True)
    scraped = kw.pop("sample", sample(running, waiting))
    return PodObservation(name=name, ready=ready, sample=scraped, **kw)


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """``patch`` applied to ``target`` as the API server applies a JSON merge patch (RFC 7386)."""
    out = dict(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value)
        else:
            out[key] = value
    return out


def spec(**over: Any) -> LLMServiceSpec:
    """A builtin-autoscaled spec: Manual target 4, 1..3 replicas, 1 replica, short windows."""
    body: dict[str, Any] = {
        "model": {"uri": "embedded://smollm2-135m"},
        "replicas": 1,
        "scaling": {"min": 1, "max": 3, "drainSeconds": 60},
        "capacity": {"mode": "Manual", "concurrencyPerReplica": 4},
        "autoscaling": {
            "mode": "builtin",
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": 0,
        },
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        elif value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return LLMServiceSpec.model_validate(body)


@dataclass
class Service:
    """One LLMService as stored, and its planner, driven tick by tick."""

    spec: LLMServiceSpec
    status: dict[str, Any] = field(default_factory=dict)
    planner: ReplicaPlanner = field(default_factory=ReplicaPlanner)
    plans: list[Plan] = field(default_factory=list)
    writes: int = 0

    @property
    def replicas(self) -> int | None:
        return self.spec.replicas

    def tick(self, now: float, pods: list[PodObservation], held: int | None = None, **obs: Any) -> Plan:
        router = None if held is None else RouterDemand(held=held, oldest_held_s=0.5 if held else None)
        plan = self.planner.plan(
            now, Observations(pods=tuple(pods), router=router, **obs), self.spec, self.status
        )
        self.apply(plan)
        return plan

    def apply(self, plan: Plan) -> None:
        """What the handler does with a plan: counts into the spec, one status write."""
        for count in plan.changes():
            if count.pool == "prefill":  # a split service's prefill pool: spec.disaggregation.prefill.replicas
                d = self.spec.disaggregation
                assert d is not None
                prefill = d.prefill.model_copy(update={"replicas": count.desired})
                self.spec = self.spec.model_copy(update={"disaggregation": d.model_copy(update={"prefill": prefill})})
            else:
                self.spec = self.spec.model_copy(update={"replicas": count.desired})
        if plan.status is not None:
            self.writes += 1
            merged = merge_patch(self.status, plan.status.fields)
            self.status.clear()
            self.status.update(merged)
            conditions = list(self.status.get("conditions") or [])
            for type_, state, reason, message in plan.status.conditions:
                conditions = set_condition(conditions, type_, state, reason, message)
            self.status["conditions"] = conditions
        self.plans.append(plan)

    def condition(self, type_: str) -> tuple[str, str] | None:
        found = next((c for c in self.status.get("conditions") or [] if c["type"] == type_), None)
        return None if found is None else (found["status"], found["reason"])

    def events(self, reason: str) -> list[str]:
        return [e.message for p in self.plans for e in p.events if e.reason == reason]
