"""`plimsoll serve`."""

from plimsoll.unbuilt import not_built


def serve() -> None:
    """Run the inference server."""
    not_built("serve", "Runtime server: OpenAI-compatible API, metrics, lifecycle")
