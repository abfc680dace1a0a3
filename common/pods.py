"""Reading a Pod object (a dict as the API server returns it).

What it is: :func:`pod_is_ready`, the one reading of a pod's Ready condition that the
operator, the router's discovery, the demo and the dev cluster's load driver share.
What it is not: a client; it never calls the API server.
"""

from __future__ import annotations

from typing import Any


def pod_is_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True (what a Service's endpoints use)."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
