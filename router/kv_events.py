"""The router's subscription to every replica's KV events, and whether each replica's view is fresh.

What it is: one ZMQ SUB socket per replica (``tcp://<pod IP>:<kv events port>``, or an endpoint
given per backend), all read by one thread and handed to the router's event loop; each batch (vLLM's schema,
``plimsoll.runtime.kv.events.decode_batch``) updates the :class:`~plimsoll.router.kv_index.KVBlockIndex`.
Sequence numbers are checked: a number lower than the last one means the replica restarted, a
skipped one means batches were lost; either way its entries are cleared (they can no longer be
trusted) and rebuilt from the events that follow. Freshness: a replica the router sent work to
must answer with events within ``stale_after_s``; one that does not (events off, a dead
publisher, a blocked port) is *stale*, and requests fall back to the approximate policy while
any candidate is stale, with a log line on each change and a metric. An idle replica that was
sent nothing is fresh: it has nothing new to say.

What it is not: the index or the policy.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from plimsoll.router.kv_index import KVBlockIndex
from plimsoll.runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

log = logging.getLogger(__name__)
# A publisher numbers its batches from its start time in microseconds (runtime/kv/events.py): a
# jump of a million or more is a new process whose first batches were missed (one that lived over
# a second), not lost batches. Either way the replica's entries are cleared; this names it in logs.
RESTART_JUMP = 1_000_000


@dataclass
class ReplicaFeed:
    endpoint: str
    last_seq: int | None = None
    last_event_at: float | None = None  # monotonic, when the last batch arrived
    waiting_since: float | None = None  # first request routed after the last batch
    batches: int = 0
    gaps: int = 0
    restarts: int = 0
    stale: bool = False


class KVEventSubscriber:
    def __init__(self, index: KVBlockIndex, *, stale_after_s: float = 5.0, topic: str = "",
                 metrics: object | None = None) -> None:  # fmt: skip
        self.index = index
        self.stale_after_s = stale_after_s
        self.topic = topic
        self.metrics = metrics
        self.feeds: dict[str, ReplicaFeed] = {}
        self.block_size: int | None = None  # from BlockStored events
        self._reader: _Reader | None = None

    # -- which replicas --------------------------------------------------------------------

    def watch(self, replica: str, endpoint: str) -> None:
        feed = self.feeds.get(replica)
        if feed is not None and feed.endpoint == endpoint:
            return
        self.unwatch(replica)
        self.feeds[replica] = ReplicaFeed(endpoint)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no running loop: a test drives handle() itself
        if self._reader is None:
            self._reader = _Reader(loop, self._deliver, self.topic)
            self._reader.start()
        self._reader.commands.put(("watch", replica, endpoint))
        log.info("subscribing to KV events of %s at %s", replica, endpoint)

    def unwatch(self, replica: str) -> None:
        if self.feeds.pop(replica, None) is not None and self._reader is not None:
            self._reader.commands.put(("unwatch", replica, ""))
        self.index.remove_replica(replica)

    def close(self) -> None:
        for replica in list(self.feeds):
            self.unwatch(replica)
        if self._reader is not None:
            self._reader.commands.put(("stop", "", ""))
            self._reader.join(timeout=2.0)
            self._reader = None

    def _deliver(self, messages: list[tuple[str, int, bytes]]) -> None:
        """On the event loop: apply what the reader thread received, in order."""
        for replica, seq, payload in messages:
            self.handle(replica, seq, payload)

    def handle(self, replica: str, seq: int, payload: bytes, now: float | None = None) -> None:
        """Apply one message ``(seq, payload)`` from ``replica``."""
        feed = self.feeds.get(replica)
        if feed is None:
            return
        now = time.monotonic() if now is None else now
        if feed.last_seq is not None and seq != feed.last_seq + 1:
            if seq <= feed.last_seq or seq - feed.last_seq > RESTART_JUMP:
                feed.restarts += 1
                log.info("KV events of %s restarted at seq %d (was %d): its index entries are cleared",
                         replica, seq, feed.last_seq)  # fmt: skip
            else:
                feed.gaps += 1
                log.warning("KV events of %s skipped seq %d..%d: its index entries are cleared and rebuilt",
                            replica, feed.last_seq + 1, seq - 1)  # fmt: skip
            self.index.clear(replica)
            self._count("resyncs")
        feed.last_seq = seq
        try:
            batch = decode_batch(payload)
        except ValueError as exc:
            log.warning("KV events of %s: dropped a malformed batch (%s)", replica, exc)
            self._count("malformed")
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.index.stored(replica, event.block_hashes, event.medium)
                if event.block_size and (event.medium in (None, "GPU")):
                    self.block_size = event.block_size
            elif isinstance(event, BlockRemoved):
                self.index.removed(replica, event.block_hashes, event.medium)
            elif isinstance(event, AllBlocksCleared):
                self.index.clear(replica)
        feed.batches += 1
        feed.last_event_at = now
        feed.waiting_since = None
        if self.metrics is not None and batch.ts:
            self.metrics.kv_event_lag.observe(max(0.0, time.time() - batch.ts))  # type: ignore[attr-defined]
        self._set_stale(replica, feed, False)

    def _count(self, what: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_event_issues.labels(what).inc()  # type: ignore[attr-defined]

    # -- freshness ------------------------------------------------------------------------------

    def note_routed(self, replica: str, now: float | None = None) -> None:
        feed = self.feeds.get(replica)
        if feed is not None and feed.waiting_since is None:
            feed.waiting_since = time.monotonic() if now is None else now

    def is_fresh(self, replica: str, now: float | None = None) -> bool:
        feed = self.feeds.get(replica)
        if feed is None:
            return False  # no endpoint for it: nothing precise can be said
        now = time.monotonic() if now is None else now
        stale = feed.waiting_since is not None and now - feed.waiting_since > self.stale_after_s
        self._set_stale(replica, feed, stale)
        return not stale

    def _set_stale(self, replica: str, feed: ReplicaFeed, stale: bool) -> None:
        if stale == feed.stale:
            return
        feed.stale = stale
        if stale:
            log.warning(
                "no KV events from %s for %.1f s after a request was routed to it; routing falls back to the "
                "approximate prefix policy while it is stale", replica, self.stale_after_s,
            )  # fmt: skip
        else:
            log.info("KV events from %s again: precise prefix routing resumes", replica)


class _Reader(threading.Thread):
    """One thread reading every replica's SUB socket with a level-triggered poller.

    A thread rather than asyncio sockets: ZMQ's file descriptor is edge-triggered, and an event loop
    that was busy when messages arrived can miss the edge and never read them. Messages go to the
    loop in batches (``call_soon_threadsafe``), so the index is only touched on the loop's thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Any, topic: str) -> None:
        super().__init__(name="kv-events-reader", daemon=True)
        self.loop = loop
        self.deliver = deliver
        self.topic = topic.encode()
        self.commands: queue.Queue[tuple[str, str, str]] = queue.Queue()

    def run(self) -> None:
        import zmq

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        poller = zmq.Poller()
        sockets: dict[str, Any] = {}
        replica_of: dict[Any, str] = {}
        while True:
            while not self.commands.empty():
                kind, replica, endpoint = self.commands.get()
                if kind == "stop":
                    for sock in sockets.values():
                        sock.close(linger=0)
                    return
                old = sockets.pop(replica, None)
                if old is not None:
                    poller.unregister(old)
                    replica_of.pop(old, None)
                    old.close(linger=0)
                if kind == "watch":
                    sock = ctx.socket(zmq.SUB)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.SUBSCRIBE, self.topic)
                    sock.connect(endpoint)
                    sockets[replica] = sock
                    replica_of[sock] = replica
                    poller.register(sock, zmq.POLLIN)
            ready = dict(poller.poll(100)) if sockets else {}
            if not sockets:
                self.commands_wait()
            batch: list[tuple[str, int, bytes]] = []
            for sock in ready:
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) == 3:
                        batch.append((replica_of[sock], int.from_bytes(frames[1], "big"), frames[2]))
            if batch:
                try:
                    self.loop.call_soon_threadsafe(self.deliver, batch)
                except RuntimeError:  # the loop closed: the router is stopping
                    return

    def commands_wait(self) -> None:
        import time as _time

        _time.sleep(0.05)


def events_endpoint(replica_url: str, port: int) -> str:
    """``tcp://HOST:PORT`` of a replica's KV event publisher, from its HTTP URL and the events port."""
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
