"""Who is overloaded: the one replica that answered, or the whole service.

What it is: the header every plimsoll refusal for lack of room carries,
``x-plimsoll-overload``, and its two values. ``replica`` (a replica's waiting queue
is full, or it is draining) means *this* replica cannot take the request now and
another one may: the router retries it elsewhere at once, and a client talking to
replicas directly should do the same. ``service`` (the router found every replica
full, its hold queue is full, or no replica is ready) means the whole service is
out of room: back off for ``Retry-After`` seconds before sending again. Both come
with ``Retry-After``; the status stays what OpenAI clients expect (429, or 503
while draining), so a client that ignores the header still backs off.

What it is not: admission itself (``runtime/serving/requests.py`` and the
router's ``proxy.py`` decide when to refuse).
"""

from __future__ import annotations

from collections.abc import Mapping

OVERLOAD_HEADER = "x-plimsoll-overload"
REPLICA = "replica"  # retry on another replica now
SERVICE = "service"  # back off for Retry-After, then retry


def overload_of(headers: Mapping[str, str]) -> str | None:
    """The overload scope a response names (``replica`` or ``service``), or None."""
    value = headers.get(OVERLOAD_HEADER)
    return value if value in (REPLICA, SERVICE) else None
