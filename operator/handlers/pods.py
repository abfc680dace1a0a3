"""An LLMService's replica pods as the API server lists them: which count, which are Ready, where they listen.

What it is: :func:`list_pods` (the replicas by the service's selector) and the
readings of a pod object the handlers share — Ready (what a Service's
endpoints use), counted for scaling (not being deleted, not finished, as the
HPA counts them), marked for removal (the ``plimsoll.dev/draining`` label),
unschedulable (no node fits it), parked in standby (the ``plimsoll.dev/standby`` label),
and the URL of one of its engine's paths on the port named ``http``.

What it is not: an HTTP client (``pod_http.py`` calls the pods) or a cache.
"""

from typing import Any

from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.kube import Kube
from plimsoll.operator.resources.labels import selector_string
from plimsoll.operator.resources.pools import prefill_selector
from plimsoll.operator.resources.settings import ENGINE_PORT
from plimsoll.operator.scaling.replica_plan import DRAINING_LABEL, STANDBY_LABEL
from plimsoll.pods import named_port
from plimsoll.pods import pod_is_ready as pod_is_ready  # the shared reading; handlers import it from here


async def list_pods(kube: Kube, svc: LLMService) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = await kube.list_objects(
        "v1", "Pod", svc.namespace, label_selector=selector_string(svc)
    )
    return pods


async def list_prefill_pods(kube: Kube, svc: LLMService) -> list[dict[str, Any]]:
    """A split service's prefill pool (its own Deployment's pods)."""
    pods: list[dict[str, Any]] = await kube.list_objects(
        "v1", "Pod", svc.namespace, label_selector=prefill_selector(svc)
    )
    return pods


def counts_for_scaling(pod: dict[str, Any]) -> bool:
    """Pods being deleted or finished are ignored entirely, as the HPA ignores them."""
    phase = (pod.get("status") or {}).get("phase")
    return not pod["metadata"].get("deletionTimestamp") and phase not in ("Failed", "Succeeded")


def is_marked_for_removal(pod: dict[str, Any]) -> bool:
    """The pod carries the draining label the two-phase scale-down puts on it."""
    return (pod["metadata"].get("labels") or {}).get(DRAINING_LABEL) == "true"


def unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's message while no node fits the pod (PodScheduled False, reason Unschedulable)."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if (
            c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ):
            return str(c.get("message") or "no node fits it")
    return None


def is_parked(pod: dict[str, Any]) -> bool:
    """The pod carries the standby label: parked asleep beside the active replicas."""
    return (pod["metadata"].get("labels") or {}).get(STANDBY_LABEL) == "true"


def pod_url(pod: dict[str, Any], path: str) -> str | None:
    """``http://<podIP>:<port named http>/<path>``, or None before the pod has an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    return f"http://{ip}:{named_port(pod, 'http', ENGINE_PORT)}{path}"


def metrics_url(pod: dict[str, Any]) -> str | None:
    return pod_url(pod, "/metrics")
