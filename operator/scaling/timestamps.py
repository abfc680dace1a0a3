"""Times as status writes them: RFC 3339 text to and from Unix seconds.

What it is: the two conversions every planner part that records a moment in
status uses (drain start, cold starts, the scale-up timeline). What it is not:
a clock; callers pass times in.
"""

from datetime import UTC, datetime


def parse_time(value: str | None) -> float | None:
    """RFC 3339 (``2026-01-02T03:04:05Z``, fractions allowed) -> Unix seconds."""
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def rfc3339(t: float) -> str:
    """Unix seconds -> RFC 3339 in UTC with hundredths of a second."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def rfc3339_seconds(t: float) -> str:
    """Unix seconds -> RFC 3339 in UTC, whole seconds (as Kubernetes stamps its own times)."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
