"""The InferencePool of an LLMService in ``router.mode: inferencePool``. Pure: spec in, object out.

What it is: a Gateway API Inference Extension ``InferencePool``
(``inference.networking.k8s.io/v1``) whose ``selector.matchLabels`` are exactly the
replica Deployment's selector labels (so router, profiling and other pods are never
in the pool) and whose ``targetPorts`` is the engine port; with
``router.endpointPickerRef`` it names the user's endpoint picker Service and failure
mode. A gateway's picker then chooses among the pool's Ready pods by their
``vllm:`` metrics, which plimsoll replicas export in this mode
(``--metrics-compat vllm``; see docs/router.md).

What it is not: an endpoint picker, an HTTPRoute or a Gateway (users bring those),
and not the code that checks the CRD is served (the reconcile does, via discovery).
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.resources.labels import common_labels, selector_labels
from plimsoll.operator.resources.settings import ENGINE_PORT

INFERENCE_POOL_GROUP_VERSION = "inference.networking.k8s.io/v1"
INFERENCE_POOL_PLURAL = "inferencepools"


def uses_inference_pool(svc: LLMService) -> bool:
    return bool(svc.spec.router.mode == "inferencePool")


def build_inference_pool(svc: LLMService) -> dict[str, Any]:
    """The InferencePool selecting ``svc``'s replicas on the engine port."""
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(svc)},
        "targetPorts": [{"number": ENGINE_PORT}],
        "appProtocol": "http",
    }
    picker = svc.spec.router.endpoint_picker_ref
    if picker is not None:
        spec["endpointPickerRef"] = {
            "kind": "Service",
            "name": picker.name,
            "port": {"number": picker.port},
            "failureMode": picker.failure_mode,
        }
    return {
        "apiVersion": INFERENCE_POOL_GROUP_VERSION,
        "kind": "InferencePool",
        "metadata": {
            "name": svc.name,
            "namespace": svc.namespace,
            "labels": common_labels(svc, component="inference-pool"),
        },
        "spec": spec,
    }
