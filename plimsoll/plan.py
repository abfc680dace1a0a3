"""`plimsoll plan`: offline capacity planning."""

from plimsoll.unbuilt import not_built


def plan() -> None:
    """Plan capacity offline."""
    not_built("plan", "Capacity profiles, replica sizing and autoscaling")
