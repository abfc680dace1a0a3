"""The operator's own traces: a span per reconcile pass and per autoscaler decision, as a receiver decodes them.

The session's operator (a real process on the local control plane) exports to a real
OTLP/HTTP receiver (``operator_traces``). One LLMService with the built-in autoscaler
yields a ``reconcile`` span naming it (what was created, whether Ready) and an
``autoscale`` span carrying the decision (replicas before and after, reason, formula).
"""

from typing import Any

import pytest
from llms_k8s import apply, llmservice
from otlp_receiver import Receiver

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(300)]


def test_reconcile_and_autoscaler_decisions_are_spans(
    devcluster: Any, llms_namespace: str, operator_traces: Receiver
) -> None:
    name = "traced"
    manifest = llmservice(name, autoscaling={"mode": "builtin", "intervalSeconds": 1}, scaling={"min": 1, "max": 3})
    apply(devcluster, llms_namespace, manifest)

    def ours(span: dict[str, Any]) -> bool:
        attrs = span["attrs"]
        return attrs.get("plimsoll.llmservice") == name and attrs.get("k8s.namespace.name") == llms_namespace

    spans = operator_traces.wait_for({("plimsoll-operator", "reconcile"), ("plimsoll-operator", "autoscale")},
                                     timeout=180, where=ours)
    reconcile = next(s for s in spans if s["name"] == "reconcile" and ours(s))
    autoscale = next(s for s in spans if s["name"] == "autoscale" and ours(s)
                     and "plimsoll.autoscaler.desired_replicas" in s["attrs"])
    print("reconcile", reconcile["attrs"])
    print("autoscale", autoscale["attrs"])
    assert f"Deployment/{name}" in reconcile["attrs"]["plimsoll.reconcile.created"]
    decision = autoscale["attrs"]
    assert decision["plimsoll.autoscaler.current_replicas"] == 1
    assert 1 <= decision["plimsoll.autoscaler.desired_replicas"] <= 3
    assert decision["plimsoll.autoscaler.reason"] and decision["plimsoll.autoscaler.formula"]
