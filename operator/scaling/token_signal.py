"""Scaling on predicted TTFT: the queue behind the knee, in seconds, against ``spec.slo.ttftP95Ms``.

What it is: :func:`predicted_ttft_recommendation`, one pure rule the replica planner
feeds into the HPA formula's stabilisation (``Autoscaler.decide(floor=...)``), beside
in-flight per replica. Each plimsoll replica exports how long a request arriving now
would wait before its prefill starts (``plimsoll_backlog_seconds``: its queue in
tokens over the prefill rate and decode step it measured, ``plimsoll.ttft_prediction``)
and the TTFT it predicts for its recent mean prompt (``plimsoll_predicted_ttft_seconds``).
Over the Ready replicas with that signal:

```
q       = mean backlog                       (queueing: what more replicas remove)
b       = mean (predicted TTFT − backlog)    (the request's own prefill and one step: they do not)
budget  = slo − b                            (≤ 0: the SLO is out of reach at any size; nothing asked)
needed  = ceil(R × q / budget)               when q > budget (R: Ready replicas with the signal,
                                              the queue spreads over more replicas)
```

Replicas that are starting count as capacity when they will be Ready no later than a
replica asked for now would be (their expected Ready = the measured cold start minus
how long they have been starting; a new replica's = the cold start, or the wake time
when a parked standby replica can be woken) and are not overdue (starting for more
than twice the cold start: stuck, not coming). So a queue that waits for replicas
already on their way asks for nothing more, and one that they would come too late
for asks for replicas that come sooner:

```
recommendation = current + max(0, needed + (Ready without the signal) − Ready − credited)
```

KV headroom (1 − KV usage, the fullest replica) is reported beside it: a replica
out of KV blocks queues requests the token predictor does not see.

What it is not: the HPA formula or its windows (``autoscaler.py``), or a reader of
the cluster (the planner passes the observations and the expected times).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from plimsoll.operator.api.base import camel_fields
from plimsoll.operator.scaling.formula import fmt
from plimsoll.operator.scaling.observations import PodObservation

# A starting replica this many cold starts past its expected Ready is stuck, not coming.
OVERDUE_FACTOR = 2.0


@dataclass(frozen=True, slots=True)
class TokenSignal:
    """The predicted-TTFT rule's verdict: a replica count to hold at least (None: it asks nothing)."""

    recommendation: int | None
    reason: str  # PredictedTTFTAboveSLO, WithinSLO, SLOUnreachable, NoTokenSignal
    formula: str
    inputs: dict[str, Any] = field(default_factory=dict)

    def to_status(self) -> dict[str, Any]:
        """``status.autoscaler.tokenAware``."""
        return camel_fields(self)


def predicted_ttft_recommendation(
    now: float,
    current: int,
    pods: tuple[PodObservation, ...],
    slo_ttft_s: float,
    cold_start_s: float,
    new_ready_s: float,
) -> TokenSignal:
    """The rule in the module docstring over ``pods`` (the counted, active ones)."""
    ready = [p for p in pods if p.ready and not p.terminating]
    signal = [
        p
        for p in ready
        if p.sample is not None and p.sample.backlog_s is not None and p.sample.predicted_ttft_s is not None
    ]
    starting = [p for p in pods if not p.ready and not p.terminating]
    kv = [1.0 - p.sample.kv_usage for p in ready if p.sample is not None and p.sample.kv_usage is not None]
    inputs: dict[str, Any] = {
        "sloTtftSeconds": slo_ttft_s,
        "readyWithSignal": len(signal),
        "readyPods": len(ready),
        "startingPods": len(starting),
        "kvHeadroom": round(min(kv), 4) if kv else None,
    }
    if not signal:
        return TokenSignal(None, "NoTokenSignal", "no Ready replica exports its backlog", inputs)
    backlogs = [p.sample.backlog_s for p in signal if p.sample is not None and p.sample.backlog_s is not None]
    bases = [
        p.sample.predicted_ttft_s - p.sample.backlog_s
        for p in signal
        if p.sample is not None and p.sample.predicted_ttft_s is not None and p.sample.backlog_s is not None
    ]
    q = sum(backlogs) / len(backlogs)
    b = max(0.0, sum(bases) / len(bases))
    budget = slo_ttft_s - b
    inputs.update(
        backlogSeconds=round(q, 4),
        predictedTtftSeconds=round(q + b, 4),
        ownPrefillAndStepSeconds=round(b, 4),
        budgetSeconds=round(budget, 4),
    )
    head = f"predicted TTFT {fmt(q + b)} s = backlog {fmt(q)} s + prefill and step {fmt(b)} s"
    if budget <= 0:
        return TokenSignal(
            None,
            "SLOUnreachable",
            f"{head}; the request's own prefill and step alone exceed the SLO {fmt(slo_ttft_s)} s",
            inputs,
        )
    if q <= budget:
        return TokenSignal(None, "WithinSLO", f"{head} ≤ SLO {fmt(slo_ttft_s)} s", inputs)
    needed = math.ceil(len(signal) * q / budget) + (len(ready) - len(signal))
    credited = []
    for pod in starting:
        age = now - pod.created_at if pod.created_at is not None else 0.0
        expected = max(0.0, cold_start_s - age)
        if expected <= new_ready_s and age <= OVERDUE_FACTOR * cold_start_s:
            credited.append(pod.name)
    capacity = len(ready) + len(credited)
    recommendation = current + max(0, needed - capacity)
    inputs.update(
        neededReplicas=needed,
        creditedStarting=len(credited),
        expectedColdStartSeconds=round(cold_start_s, 3),
        newReplicaReadySeconds=round(new_ready_s, 3),
    )
    formula = (
        f"{head} > SLO {fmt(slo_ttft_s)} s; ceil({len(signal)} × {fmt(q)} / {fmt(budget)})"
        f"{f' + {len(ready) - len(signal)}' if len(ready) > len(signal) else ''} = {needed} needed; "
        f"{len(ready)} Ready + {len(credited)} starting in time = {capacity}; "
        f"{current} + {max(0, needed - capacity)} = {recommendation}"
    )
    return TokenSignal(recommendation, "PredictedTTFTAboveSLO", formula, inputs)
