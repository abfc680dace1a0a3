"""The router's subscription to every replica's KV events, and whether each replica's view is fresh.

What it is: one ZMQ SUB socket per replica (``tcp://<pod IP>:<kv events port>``, or an endpoint
given per backend), read on the router's event loop; each batch (vLLM's schema,
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
import contextlib
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from plimsoll.router.kv_index import KVBlockIndex
from plimsoll.runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

log = logging.getLogger(__name__)


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
    task: asyncio.Task[None] | None = None


class KVEventSubscriber:
    def __init__(self, index: KVBlockIndex, *, stale_after_s: float = 5.0, topic: str = "",
                 metrics: object | None = None) -> None:  # fmt: skip
        self.index = index
        self.stale_after_s = stale_after_s
        self.topic = topic
        self.metrics = metrics
        self.feeds: dict[str, ReplicaFeed] = {}
        self.block_size: int | None = None  # from BlockStored events
        self._ctx: object | None = None

    # -- which replicas --------------------------------------------------------------------

    def watch(self, replica: str, endpoint: str) -> None:
        feed = self.feeds.get(replica)
        if feed is not None and feed.endpoint == endpoint:
            return
        self.unwatch(replica)
        feed = ReplicaFeed(endpoint)
        self.feeds[replica] = feed
        with contextlib.suppress(RuntimeError):  # no running loop (a test driving handle() itself)
            feed.task = asyncio.get_running_loop().create_task(
                self._run(replica, feed), name=f"kv-events {replica}"
            )

    def unwatch(self, replica: str) -> None:
        feed = self.feeds.pop(replica, None)
        if feed is not None and feed.task is not None:
            feed.task.cancel()
        self.index.remove_replica(replica)

    def close(self) -> None:
        for replica in list(self.feeds):
            self.unwatch(replica)

    # -- events ------------------------------------------------------------------------------

    async def _run(self, replica: str, feed: ReplicaFeed) -> None:
        import zmq
        import zmq.asyncio

        if self._ctx is None:
            self._ctx = zmq.asyncio.Context.instance()
        sock = self._ctx.socket(zmq.SUB)  # type: ignore[attr-defined]
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(feed.endpoint)
        log.info("subscribed to KV events of %s at %s", replica, feed.endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) == 3:
                    self.handle(replica, int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sock.close(linger=0)

    def handle(self, replica: str, seq: int, payload: bytes, now: float | None = None) -> None:
        """Apply one message ``(seq, payload)`` from ``replica``."""
        feed = self.feeds.get(replica)
        if feed is None:
            return
        now = time.monotonic() if now is None else now
        if feed.last_seq is not None and seq != feed.last_seq + 1:
            if seq <= feed.last_seq:
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


def events_endpoint(replica_url: str, port: int) -> str:
    """``tcp://HOST:PORT`` of a replica's KV event publisher, from its HTTP URL and the events port."""
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
