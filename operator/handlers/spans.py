"""OpenTelemetry spans for the operator's decisions: each reconcile pass and each autoscaler tick.

What it is: :func:`llmservice_span` opens a span named after the work (``reconcile``,
``autoscale``) with the object's namespace and name; :func:`decision_attributes` turns an
autoscaler :class:`Decision` into span attributes (replicas before and after, the reason,
the formula and its inputs), so a trace shows why a count changed. The spans go where
``plimsoll operator --otlp-traces-endpoint`` points (``plimsoll.tracing``); without it
the no-op tracer makes them free.

What it is not: the decision itself (``operator/scaling``) or a log line; Events and
``status.autoscaler`` stay the user's first explanation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry.trace import Span

from plimsoll.operator.scaling.autoscaler import Decision
from plimsoll.tracing import tracer


@contextmanager
def llmservice_span(name: str, namespace: str, service: str) -> Iterator[Span]:
    """A span for work on one LLMService; an exception escaping it marks the span as an error."""
    attributes = {"k8s.namespace.name": namespace, "plimsoll.llmservice": service}
    with tracer().start_as_current_span(name, attributes=attributes) as span:
        yield span


def decision_attributes(decision: Decision) -> dict[str, Any]:
    """The autoscaler's verdict as span attributes (no pod names: they are unbounded)."""
    attributes: dict[str, Any] = {
        "plimsoll.autoscaler.current_replicas": decision.current_replicas,
        "plimsoll.autoscaler.desired_replicas": decision.desired_replicas,
        "plimsoll.autoscaler.changed": decision.changed,
        "plimsoll.autoscaler.reason": decision.reason,
        "plimsoll.autoscaler.formula": decision.formula,
        "plimsoll.autoscaler.target": decision.target,
        "plimsoll.autoscaler.target_source": decision.target_source,
        "plimsoll.autoscaler.in_flight": decision.in_flight,
        "plimsoll.autoscaler.waiting": decision.waiting,
        "plimsoll.autoscaler.ready_pods": len(decision.ready_pods),
        "plimsoll.autoscaler.scaling_limited": decision.scaling_limited,
    }
    if decision.metric is not None:
        attributes["plimsoll.autoscaler.metric"] = decision.metric
    if decision.limited_reason is not None:
        attributes["plimsoll.autoscaler.limited_reason"] = decision.limited_reason
    return attributes
