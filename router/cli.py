"""`plimsoll route`."""

from plimsoll.unbuilt import not_built


def route() -> None:
    """Run the router."""
    not_built("route", "Router: queue-aware, prefix-affine load balancing")
