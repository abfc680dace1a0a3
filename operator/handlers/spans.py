"""OpenTelemetry spans for the operator's decisions: each reconcile pass and each autoscaler tick.

What it is: :func:`llmservice_span` opens a span named after the work (``reconcile``,
``autoscale``) with the object's namespace and name; the autoscale span carries the
planner's verdict (``Decision.span_attributes``: replicas before and after, the reason,
the formula and its inputs), so a trace shows why a count changed. The spans go where
``plimsoll operator --otlp-traces-endpoint`` points (``plimsoll.tracing``); without it
the no-op tracer makes them free.

What it is not: the decision itself (``operator/scaling``) or a log line; Events and
``status.autoscaler`` stay the user's first explanation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.trace import Span

from plimsoll.tracing import tracer


@contextmanager
def llmservice_span(name: str, namespace: str, service: str) -> Iterator[Span]:
    """A span for work on one LLMService; an exception escaping it marks the span as an error."""
    attributes = {"k8s.namespace.name": namespace, "plimsoll.llmservice": service}
    with tracer().start_as_current_span(name, attributes=attributes) as span:
        yield span

