"""The scale-up SLO budget: where the time went between "more load" and "the new replica answers".

What it is: :class:`ScaleUpTimeline`, opened by the autoscaler loop when it
decides a scale-up and fed every tick with the service's pods and the ready
pods' scrapes. It follows the first pod created after the decision and marks,
in order (:data:`PHASES`):

- ``metricCrossedTarget`` — the first tick whose in-flight per replica exceeded the target
  (the loop passes it in), ``decided`` — the scale-up decision;
- ``podCreated``, ``podScheduled``, ``containerStarted``, ``ready`` — from the pod object
  (``creationTimestamp``, the ``PodScheduled`` and ``Ready`` conditions, the engine
  container's ``startedAt``);
- ``imports``, ``weightsLoaded``, ``kvCacheAllocated``, ``warmupDone`` — the engine's
  own start-up phases (``plimsoll_startup_phase_seconds`` + ``process_start_time_seconds``);
- ``firstRequestAnswered`` — the first tick its success counter was above zero.

:meth:`to_status` is ``status.autoscaler.lastScaleUp``, :meth:`sentence` the
Event, :meth:`phase_seconds` what each phase took (the gap from the mark
before it) for ``plimsoll_operator_scale_up_phase_seconds{phase}``.

What it is not: a reader of the cluster (the handler passes pods and samples
in). Kubernetes timestamps have one-second resolution and the engine's marks
come from the node's clock, so a mark may read up to a second before the one
before it; :meth:`phase_seconds` counts such a gap as zero, and the status
keeps the raw times. The first request is seen at tick resolution
(``autoscaling.intervalSeconds``). vLLM replicas report no engine phases:
those marks stay empty and the timeline completes without them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.scaling.formula import fmt
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.timestamps import parse_time, rfc3339

PHASES = (
    "metricCrossedTarget",
    "decided",
    "podCreated",
    "podScheduled",
    "containerStarted",
    "imports",
    "weightsLoaded",
    "kvCacheAllocated",
    "warmupDone",
    "ready",
    "firstRequestAnswered",
)
# The runtime's phase names (plimsoll_startup_phase_seconds{phase}) -> ours.
ENGINE_PHASES = {
    "imports": "imports",
    "weights_loaded": "weightsLoaded",
    "kv_cache_allocated": "kvCacheAllocated",
    "warmup_done": "warmupDone",
}
_WORDS = {
    "metricCrossedTarget": "in-flight crossed the target",
    "decided": "decided",
    "podCreated": "pod {pod} created",
    "podScheduled": "scheduled",
    "containerStarted": "container started",
    "imports": "imports done",
    "weightsLoaded": "weights loaded",
    "kvCacheAllocated": "KV cache allocated",
    "warmupDone": "warm-up done",
    "ready": "Ready",
    "firstRequestAnswered": "first request answered",
}


def _condition_time(pod: Mapping[str, Any], type_: str) -> float | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return parse_time(c.get("lastTransitionTime"))
    return None


def _container_started(pod: Mapping[str, Any], container: str | None) -> float | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if container is not None and cs.get("name") != container:
            continue
        running = (cs.get("state") or {}).get("running") or {}
        if running.get("startedAt"):
            return parse_time(running["startedAt"])
    return None


@dataclass
class ScaleUpTimeline:
    """One scale-up, from the metric crossing the target to the new pod's first answer."""

    crossed_at: float
    decided_at: float
    from_replicas: int
    to_replicas: int
    existing_pods: frozenset[str]  # pods there at the decision: not the new one
    container: str | None = None  # the engine container's name
    pod: str | None = None
    marks: dict[str, float] = field(default_factory=dict)
    engine_reports_phases: bool = True

    def __post_init__(self) -> None:
        self.marks.setdefault("metricCrossedTarget", min(self.crossed_at, self.decided_at))
        self.marks.setdefault("decided", self.decided_at)

    def observe(
        self, now: float, pods: Sequence[Mapping[str, Any]], samples: Mapping[str, PodSample]
    ) -> None:
        """Mark what the pods and scrapes show by ``now``."""
        if self.pod is None:
            new = [
                p for p in pods
                if p["metadata"]["name"] not in self.existing_pods and not p["metadata"].get("deletionTimestamp")
            ]  # fmt: skip
            if not new:
                return
            first = min(
                new, key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"])
            )
            self.pod = str(first["metadata"]["name"])
        pod = next((p for p in pods if p["metadata"]["name"] == self.pod), None)
        if pod is None:
            return  # gone before it answered: the timeline stays incomplete
        found = {
            "podCreated": parse_time(pod["metadata"].get("creationTimestamp")),
            "podScheduled": _condition_time(pod, "PodScheduled"),
            "containerStarted": _container_started(pod, self.container),
            "ready": _condition_time(pod, "Ready"),
        }
        for phase, at in found.items():
            if at is not None:
                self.marks.setdefault(phase, at)
        sample = samples.get(self.pod)
        if sample is None:
            return
        # A scraped pod is Ready, so its engine has marked every phase it knows (vLLM marks none).
        self.engine_reports_phases = bool(sample.startup)
        for theirs, ours in ENGINE_PHASES.items():
            if theirs in sample.startup:
                self.marks.setdefault(ours, sample.startup[theirs])
        if (sample.requests_finished or 0.0) > 0:
            self.marks.setdefault("firstRequestAnswered", now)

    def expected_phases(self) -> tuple[str, ...]:
        if self.engine_reports_phases:
            return PHASES
        return tuple(p for p in PHASES if p not in ENGINE_PHASES.values())

    @property
    def complete(self) -> bool:
        return all(p in self.marks for p in self.expected_phases())

    def phase_seconds(self) -> dict[str, float]:
        """Phase -> seconds from the mark before it (the first phase: 0), marks reached only."""
        out: dict[str, float] = {}
        previous: float | None = None
        for phase in PHASES:
            at = self.marks.get(phase)
            if at is None:
                continue
            out[phase] = 0.0 if previous is None else round(max(0.0, at - previous), 3)
            previous = at if previous is None else max(previous, at)
        return out

    def to_status(self) -> dict[str, Any]:
        """``status.autoscaler.lastScaleUp``."""
        took = self.phase_seconds()
        return {
            "fromReplicas": self.from_replicas,
            "toReplicas": self.to_replicas,
            "pod": self.pod,
            "complete": self.complete,
            "decisionToReadySeconds": self._between("decided", "ready"),
            "decisionToFirstAnswerSeconds": self._between("decided", "firstRequestAnswered"),
            "phases": [
                {"phase": p, "at": rfc3339(self.marks[p]), "seconds": took[p]}
                for p in PHASES
                if p in self.marks
            ],
        }

    def _between(self, a: str, b: str) -> float | None:
        if a not in self.marks or b not in self.marks:
            return None
        return round(max(0.0, self.marks[b] - self.marks[a]), 3)

    def sentence(self) -> str:
        """The Event: every phase with its time from the decision."""
        base = self.marks["decided"]
        parts = []
        for phase in PHASES:
            if phase not in self.marks:
                continue
            offset = self.marks[phase] - base
            parts.append(
                f"{_WORDS[phase].format(pod=self.pod)} at {'+' if offset >= 0 else '-'}{fmt(abs(offset))} s"
            )
        missing = [p for p in self.expected_phases() if p not in self.marks]
        tail = f"; not seen: {', '.join(missing)}" if missing else ""
        return f"scale-up {self.from_replicas}→{self.to_replicas}: " + ", ".join(parts) + tail
