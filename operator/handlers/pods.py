"""An LLMService's replica pods as the API server lists them: which count, which are Ready, where they listen.

What it is: :func:`list_pods` (the replicas by the service's selector) and the
readings of a pod object the handlers share — Ready (what a Service's
endpoints use), counted for scaling (not being deleted, not finished, as the
HPA counts them), marked for removal (the ``plimsoll.dev/draining`` label), and
the URL of one of its engine's paths on the port named ``http``.

What it is not: an HTTP client (``pod_http.py`` calls the pods) or a cache.
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.resources.labels import selector_string
from plimsoll.operator.resources.settings import ENGINE_PORT
from plimsoll.operator.scaling.replica_plan import DRAINING_LABEL


async def list_pods(kube: Kube, svc: LLMService) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = await kube.list_objects(
        "v1", "Pod", svc.namespace, label_selector=selector_string(svc)
    )
    return pods


def pod_is_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True (what a Service's endpoints use)."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def counts_for_scaling(pod: dict[str, Any]) -> bool:
    """Pods being deleted or finished are ignored entirely, as the HPA ignores them."""
    phase = (pod.get("status") or {}).get("phase")
    return not pod["metadata"].get("deletionTimestamp") and phase not in ("Failed", "Succeeded")


def is_marked_for_removal(pod: dict[str, Any]) -> bool:
    """The pod carries the draining label the two-phase scale-down puts on it."""
    return (pod["metadata"].get("labels") or {}).get(DRAINING_LABEL) == "true"


def pod_url(pod: dict[str, Any], path: str) -> str | None:
    """``http://<podIP>:<port named http>/<path>``, or None before the pod has an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = ENGINE_PORT
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == "http":
                port = int(p["containerPort"])
    return f"http://{ip}:{port}{path}"


def metrics_url(pod: dict[str, Any]) -> str | None:
    return pod_url(pod, "/metrics")
