"""OpenTelemetry tracing shared by ``serve``, ``route`` and the operator.

What it is: :func:`configure_tracing` installs an SDK tracer provider that ships
spans over OTLP/HTTP (protobuf) to ``--otlp-traces-endpoint``; :class:`TraceMiddleware`
is a plain ASGI middleware that accepts a W3C ``traceparent``, opens the server
span and keeps it current while the response (SSE included) is produced;
:func:`inject_headers` puts the current context on an outgoing request; and
:func:`span_at` records a span whose times are already known (engine phases are
measured by the engine on its monotonic clock and turned into spans afterwards).
Without ``configure_tracing`` the API's no-op tracer is used and nothing is sent.

What it is not: metrics or logs; no prompt or completion text is ever put on a span.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

TRACER_NAME = "plimsoll"


def configure_tracing(service_name: str, endpoint: str) -> None:
    """Send this process's spans to an OTLP/HTTP endpoint (e.g. http://collector:4318/v1/traces)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL, got {endpoint!r}")
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject_headers(headers: list[tuple[str, str]]) -> None:
    """Append ``traceparent`` (and ``tracestate``) for the current span to outgoing headers."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    headers[:] = [(k, v) for k, v in headers if k.lower() not in carrier] + list(carrier.items())


def monotonic_to_ns(t: float) -> int:
    """Wall-clock nanoseconds for a ``time.monotonic()`` stamp taken in this process."""
    return time.time_ns() - time.monotonic_ns() + int(t * 1e9)


def span_at(
    name: str, start: float, end: float, attributes: dict[str, Any], parent: trace.Span | None = None
) -> trace.Span:
    """A finished span between two monotonic stamps, child of ``parent`` (default: the current span)."""
    ctx = trace.set_span_in_context(parent) if parent is not None else None
    span = tracer().start_span(name, context=ctx, start_time=monotonic_to_ns(start), attributes=attributes)
    span.end(end_time=monotonic_to_ns(max(start, end)))
    return span


class TraceMiddleware:
    """Open a SERVER span per HTTP request, continuing the caller's ``traceparent`` if any."""

    def __init__(self, app: Any, skip: tuple[str, ...] = ("/metrics", "/health", "/ready")) -> None:
        self.app = app
        self.skip = skip

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.skip:
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        parent = propagate.extract(carrier)
        name = f"{scope['method']} {scope['path']}"
        status_code = 0

        async def send_and_record(message: Any) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = int(message["status"])
            await send(message)

        with tracer().start_as_current_span(
            name,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"]},
        ) as span:
            try:
                await self.app(scope, receive, send_and_record)
            finally:
                span.set_attribute("http.response.status_code", status_code)
                if status_code >= 500:
                    span.set_status(Status(StatusCode.ERROR))
