"""Waiting for a server this process started to answer its readiness endpoint.

What it is: :func:`wait_until_ready`, the poll loop the test server, the simulator and
the benchmark scripts share: GET one URL until it answers 200, stopping early with the
caller's message when the server's process or thread has died. What it is not: a
health checker for servers this process did not start (the operator and the router
read replicas' endpoints themselves, with byte caps), nor a retry policy for requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx


def wait_until_ready(
    url: str,
    timeout_s: float,
    died: Callable[[], str | None],
    *,
    interval_s: float = 0.2,
    request_timeout_s: float = 2.0,
) -> bool:
    """True once ``GET url`` answers 200; False when ``timeout_s`` passes first.

    ``died`` is asked before each attempt: a message from it (the server exited, its
    thread stopped) raises ``RuntimeError`` with that message, so a server that failed
    to start is reported at once rather than after the whole timeout.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        reason = died()
        if reason is not None:
            raise RuntimeError(reason)
        try:
            if httpx.get(url, timeout=request_timeout_s).status_code == 200:
                return True
        except httpx.HTTPError:
            pass  # not listening yet, or reset while starting
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
