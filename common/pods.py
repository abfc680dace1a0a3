"""Reading a Pod object (a dict as the API server returns it).

What it is: :func:`pod_is_ready`, the one reading of a pod's Ready condition that the
operator, the router's discovery, the demo and the dev cluster's load driver share, and
:func:`named_port`, the port a pod's containers call by a name (the operator's scrapes and
the load driver find the engine by ``http``).
What it is not: a client; it never calls the API server.
"""

from __future__ import annotations

from typing import Any


def pod_is_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True (what a Service's endpoints use)."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def named_port(pod: dict[str, Any], name: str, default: int) -> int:
    """The ``containerPort`` a container of the pod names ``name`` (the last one), else ``default``."""
    port = default
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == name:
                port = int(p["containerPort"])
    return port
