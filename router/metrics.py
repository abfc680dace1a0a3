"""The router's own Prometheus series, all under ``plimsoll_router_``.

What it is: one registry per router (so tests can run several routers in one
process) holding per-replica in-flight/waiting/ready gauges, routing decisions
by policy, reason and lane, retries, upstream errors, 429 rejections, request
latency and in-flight migrations by outcome. Labels stay low-cardinality: the replica URL (bounded by the replica
count), the endpoint path and the status code; never a prompt or request id.
What it is not: the replicas' metrics; those are scraped by the operator.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from plimsoll.metric_names import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from plimsoll.router.migration import OUTCOMES

if TYPE_CHECKING:
    from plimsoll.router.backends import ReplicaSet

PREFIX = "plimsoll_router_"


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        # Every series is PREFIX + its name; counters are exported with a ``_total`` suffix.
        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()
        ) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.inflight = gauge(
            "replica_inflight", "Requests this router has in flight on each replica.", ("replica",)
        )
        self.waiting = gauge(
            "replica_waiting", "Waiting queue last scraped from each replica's /metrics.", ("replica",)
        )
        self.ready = gauge(
            "replica_ready", "1 when the replica is ready and reachable, else 0.", ("replica",)
        )
        self.decisions = counter(
            "routing_decisions", "Routing decisions by policy, reason and lane.", ("policy", "reason", "lane")
        )
        self.retries = counter(
            "retries",
            "Requests re-sent to another replica before the client got any byte: the connection failed, "
            "or the replica refused as overloaded or draining (x-plimsoll-overload: replica).",
            ("replica",),
        )
        self.upstream_errors = counter(
            "upstream_errors",
            "Failures talking to a replica, by kind (connect, read, stream_broken).",
            ("replica", "kind"),
        )
        self.rejections = counter(
            "rejections",
            "Requests the router answered itself, by reason (saturated -> 429, hold_full -> 429, "
            "slo_ttft -> 429, no_replica -> 503, hold_timeout -> 503, upstream_failed -> 502).",
            ("reason",),
        )
        self.duration = histogram(
            "request_duration_seconds",
            "Request latency through the router, arrival to last byte.",
            REQUEST_LATENCY_BUCKETS,
            ("endpoint", "code"),
        )
        self.first_byte = histogram(
            "time_to_first_byte_seconds",
            "Arrival to the first body byte from the replica (TTFT for streams).",
            TTFT_BUCKETS,
            ("endpoint",),
        )
        self.held = gauge("held_requests", "Requests held while no replica is Ready (scale from zero).")
        self.hold_seconds = histogram(
            "hold_duration_seconds",
            "Time a request spent held before a replica took it.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.migrations = counter(
            "migrations",
            "Started requests whose replica failed, by what became of them "
            "(migrated, completed, limit_reached, no_replica, refused, unsupported).",
            ("outcome",),
        )
        for outcome in OUTCOMES:
            self.migrations.labels(outcome)
        # Parked replicas this router woke itself (router/standby_wake.py): every awake one was past its target.
        self.standby_wakes = counter(
            "standby_wakes", "Parked (standby) replicas this router woke, by outcome (woken, failed).", ("outcome",)
        )
        for outcome in ("woken", "failed"):
            self.standby_wakes.labels(outcome)
        self.standby_wake_seconds = histogram(
            "standby_wake_seconds",
            "POST /wake_up to its answer, for the parked replicas this router woke.",
            (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0),
        )
        # Precise prefix routing (--policy precise-prefix): the KV index and the event feeds behind it.
        self.kv_index_blocks = gauge("kv_index_blocks", "Distinct KV block hashes in the router's index.")
        self.kv_index_replicas = gauge("kv_index_replicas", "Replicas with entries in the KV index.")
        self.kv_event_lag = histogram(
            "kv_event_lag_seconds",
            "Publish-to-apply delay of a KV event batch (replica clock to router clock).",
            (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self.kv_event_issues = counter(
            "kv_event_issues",
            "KV event feed problems by kind (resyncs after a sequence gap or a restart, malformed batches).",
            ("kind",),
        )
        self.kv_events_stale = gauge(
            "kv_events_stale",
            "1 while a replica's KV events are stale (routing falls back to the approximate prefix policy).",
            ("replica",),
        )
        self.kv_event_batches = gauge(
            "kv_event_batches", "KV event batches applied per replica.", ("replica",)
        )
        self._known: set[str] = set()

    def observe_replicas(self, replica_set: ReplicaSet) -> None:
        """Refresh the per-replica gauges; drop the series of replicas that left."""
        current = set(replica_set.replicas)
        for gone in self._known - current:
            for gauge in (self.inflight, self.waiting, self.ready):
                gauge.remove(gone)
            for gauge in (self.kv_events_stale, self.kv_event_batches):
                with contextlib.suppress(KeyError):
                    gauge.remove(gone)
        self._known = current
        for url, replica in replica_set.replicas.items():
            self.inflight.labels(url).set(replica.inflight)
            self.waiting.labels(url).set(replica.waiting or 0.0)
            self.ready.labels(url).set(1.0 if replica.is_ready else 0.0)

    def observe_kv(self, subscriber: Any) -> None:
        """Refresh the KV index gauges (--policy precise-prefix)."""
        self.kv_index_blocks.set(len(subscriber.index))
        self.kv_index_replicas.set(len(subscriber.index.slot_of))
        for url, feed in subscriber.feeds.items():
            self.kv_events_stale.labels(url).set(1.0 if feed.stale else 0.0)
            self.kv_event_batches.labels(url).set(feed.batches)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
