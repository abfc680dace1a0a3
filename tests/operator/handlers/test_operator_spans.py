"""The operator's spans carry its decision: an autoscaler verdict as attributes, errors marked.

The real OpenTelemetry SDK (an in-memory exporter) records what ``llmservice_span`` and
``Decision.span_attributes`` produce for a real ``Autoscaler.decide`` verdict, so the values
are ones OTLP accepts (no None, no objects). The end-to-end path (operator process ->
OTLP receiver) is ``test_operator_traces_k8s.py``.
"""

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from typer.testing import CliRunner

from plimsoll.cli import app
from plimsoll.operator.handlers import spans
from plimsoll.operator.scaling.autoscaler import Autoscaler, AutoscalerConfig
from plimsoll.operator.scaling.metrics import PodSample
from plimsoll.operator.scaling.observations import PodObservation


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # The global provider can be set once per process; the module's tracer is pointed here instead.
    monkeypatch.setattr(spans, "tracer", lambda: provider.get_tracer("plimsoll"))
    yield exporter
    provider.shutdown()


def busy(name: str, running: float) -> PodObservation:
    sample = PodSample(engine="plimsoll", running=running, waiting=0.0, kv_usage=None, ttft=None, tpot=None)
    return PodObservation(name=name, ready=True, sample=sample)


def test_an_autoscaler_decision_is_recorded_on_its_span(exported: InMemorySpanExporter) -> None:
    scaler = Autoscaler(AutoscalerConfig.model_validate({"target_per_replica": 4, "min_replicas": 1, "max_replicas": 3}))
    decision = scaler.decide(1000.0, 1, [busy("p0", 12)])
    with spans.llmservice_span("autoscale", "team-a", "chat") as span:
        span.set_attributes(decision.span_attributes())
    (recorded,) = exported.get_finished_spans()
    attrs = dict(recorded.attributes or {})
    print(recorded.name, attrs)
    assert recorded.name == "autoscale"
    assert attrs["k8s.namespace.name"] == "team-a" and attrs["plimsoll.llmservice"] == "chat"
    assert attrs["plimsoll.autoscaler.current_replicas"] == 1
    assert attrs["plimsoll.autoscaler.desired_replicas"] == decision.desired_replicas
    assert attrs["plimsoll.autoscaler.formula"] == decision.formula and attrs["plimsoll.autoscaler.reason"]
    assert attrs["plimsoll.autoscaler.in_flight"] == 12
    assert all(v is not None for v in attrs.values())


def test_a_failed_pass_is_an_error_span(exported: InMemorySpanExporter) -> None:
    with pytest.raises(RuntimeError), spans.llmservice_span("reconcile", "team-a", "chat"):
        raise RuntimeError("apiserver went away")
    (recorded,) = exported.get_finished_spans()
    assert recorded.status.status_code is StatusCode.ERROR
    assert any(e.name == "exception" for e in recorded.events)


def test_operator_help_lists_the_traces_flag() -> None:
    result = CliRunner().invoke(app, ["operator", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--otlp-traces-endpoint" in result.output
