"""A shared-tier URL as it may be shown: any password in it replaced by ``***``.

What it is: :func:`redacted_url`, for log lines and error messages that name the server of
the shared KV tier (``redis://user:secret@host:6379/0`` → ``redis://user:***@host:6379/0``).
What it is not: parsing for use (redis-py parses the real URL) or validation (``config.py``).
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redacted_url(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<an unparseable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
