"""`plimsoll demo`: the whole path on the embedded model, locally."""

from plimsoll.unbuilt import not_built


def demo() -> None:
    """Run the demo."""
    not_built("demo", "Capacity profiles, replica sizing and autoscaling")
