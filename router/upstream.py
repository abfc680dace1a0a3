"""One request's connection to one replica, watched so a lost replica ends it at once.

What it is: :func:`send_watched` sends a request and waits for the answer's headers, and
:class:`Leg` reads the answer's body in a background task; both give up with
:class:`plimsoll.router.migration.ReplicaFailed` as soon as the scraper finds the replica
lost (its readiness probes refused, or unanswered while it sends nothing; ``backends.py``). A killed
process resets its connections and the read fails by itself; a replica whose node or
network is gone sends nothing at all, and without this the stream would wait forever.

Also the two readings of an answer's headers the retry and migration rules need. What it
is not: what to do about a failure (``proxy.py`` migrates or fails the request).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from plimsoll.overload import REPLICA, overload_of
from plimsoll.router.backends import Replica
from plimsoll.router.migration import ReplicaFailed

_END = object()


def refused_for_itself(response: httpx.Response) -> bool:
    """A refusal another replica may not share: overloaded or draining (its header says so), or a 502/503."""
    return overload_of(response.headers) == REPLICA or response.status_code in (502, 503)


def is_event_stream(response: httpx.Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.startswith("text/event-stream")


def _lost(replica: Replica) -> ReplicaFailed:
    return ReplicaFailed(
        f"replica {replica.url} is lost (its readiness probes get no answer)", transport=True
    )


async def send_watched(client: httpx.AsyncClient, request: httpx.Request, replica: Replica) -> httpx.Response:
    """``client.send(request, stream=True)``, or ``ReplicaFailed`` if the replica is lost first."""
    task = asyncio.ensure_future(client.send(request, stream=True))
    lost = False

    def on_lost() -> None:
        nonlocal lost
        lost = True
        task.cancel()

    replica.lost_listeners.add(on_lost)
    try:
        return await task
    except asyncio.CancelledError:
        if lost:
            raise _lost(replica) from None
        raise
    finally:
        replica.lost_listeners.discard(on_lost)


class Leg:
    """The answer of one replica to one request, its body read by a background task."""

    def __init__(self, response: httpx.Response, replica: Replica) -> None:
        self.response = response
        self.replica = replica
        self.closed = False
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read())
        replica.lost_listeners.add(self._on_lost)

    async def _read(self) -> None:
        try:
            async for chunk in self.response.aiter_raw():
                self.replica.heard()  # a replica sending tokens is alive, however slow its probes
                self._queue.put_nowait(chunk)
            self._queue.put_nowait(_END)
        except httpx.HTTPError as exc:
            self._queue.put_nowait(exc)

    def _on_lost(self) -> None:
        self._queue.put_nowait(_lost(self.replica))

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises ``httpx.HTTPError`` or ``ReplicaFailed`` when the replica fails."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, bytes)
            yield item

    async def close(self) -> None:
        """Stop reading and close the connection (the replica aborts the request if it still runs)."""
        if self.closed:
            return
        self.closed = True
        self.replica.lost_listeners.discard(self._on_lost)
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self.response.aclose()
