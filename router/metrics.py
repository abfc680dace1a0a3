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
REPLICA_INFLIGHT = PREFIX + "replica_inflight"
REPLICA_WAITING = PREFIX + "replica_waiting"
REPLICA_READY = PREFIX + "replica_ready"
ROUTING_DECISIONS = PREFIX + "routing_decisions"  # exported as ..._total
RETRIES = PREFIX + "retries"
UPSTREAM_ERRORS = PREFIX + "upstream_errors"
REJECTIONS = PREFIX + "rejections"
REQUEST_DURATION = PREFIX + "request_duration_seconds"
TIME_TO_FIRST_BYTE = PREFIX + "time_to_first_byte_seconds"
HELD_REQUESTS = PREFIX + "held_requests"
HOLD_DURATION = PREFIX + "hold_duration_seconds"
MIGRATIONS = PREFIX + "migrations"  # exported as ..._total
KV_INDEX_BLOCKS = PREFIX + "kv_index_blocks"
KV_INDEX_REPLICAS = PREFIX + "kv_index_replicas"
KV_EVENT_LAG = PREFIX + "kv_event_lag_seconds"
KV_EVENT_ISSUES = PREFIX + "kv_event_issues"
KV_EVENTS_STALE = PREFIX + "kv_events_stale"
KV_EVENT_BATCHES = PREFIX + "kv_event_batches"


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.inflight = Gauge(REPLICA_INFLIGHT, "Requests this router has in flight on each replica.",
                              ["replica"], registry=r)
        self.waiting = Gauge(REPLICA_WAITING, "Waiting queue last scraped from each replica's /metrics.",
                             ["replica"], registry=r)
        self.ready = Gauge(REPLICA_READY, "1 when the replica is ready and reachable, else 0.",
                           ["replica"], registry=r)
        self.decisions = Counter(ROUTING_DECISIONS, "Routing decisions by policy, reason and lane.",
                                 ["policy", "reason", "lane"], registry=r)
        self.retries = Counter(RETRIES, "Requests re-sent to another replica before the client got any byte: "
                               "the connection failed, or the replica refused as overloaded or draining "
                               "(x-plimsoll-overload: replica).", ["replica"], registry=r)
        self.upstream_errors = Counter(UPSTREAM_ERRORS, "Failures talking to a replica, by kind "
                                       "(connect, read, stream_broken).", ["replica", "kind"], registry=r)
        self.rejections = Counter(REJECTIONS, "Requests the router answered itself, by reason "
                                  "(saturated -> 429, hold_full -> 429, slo_ttft -> 429, no_replica -> 503, hold_timeout -> 503, "
                                  "upstream_failed -> 502).",
                                  ["reason"], registry=r)
        self.duration = Histogram(REQUEST_DURATION, "Request latency through the router, arrival to last byte.",
                                  ["endpoint", "code"], buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.first_byte = Histogram(TIME_TO_FIRST_BYTE, "Arrival to the first body byte from the replica "
                                    "(TTFT for streams).", ["endpoint"], buckets=TTFT_BUCKETS, registry=r)
        self.held = Gauge(HELD_REQUESTS, "Requests held while no replica is Ready (scale from zero).", registry=r)
        self.hold_seconds = Histogram(HOLD_DURATION, "Time a request spent held before a replica took it.",
                                      buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.migrations = Counter(MIGRATIONS, "Started requests whose replica failed, by what became of them "
                                  "(migrated, completed, limit_reached, no_replica, refused, unsupported).",
                                  ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.migrations.labels(outcome)
        # Precise prefix routing (--policy precise-prefix): the KV index and the event feeds behind it.
        self.kv_index_blocks = Gauge(KV_INDEX_BLOCKS, "Distinct KV block hashes in the router's index.", registry=r)
        self.kv_index_replicas = Gauge(KV_INDEX_REPLICAS, "Replicas with entries in the KV index.", registry=r)
        self.kv_event_lag = Histogram(KV_EVENT_LAG, "Publish-to-apply delay of a KV event batch (replica clock "
                                      "to router clock).", buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                                      0.5, 1.0, 2.5, 5.0), registry=r)  # fmt: skip
        self.kv_event_issues = Counter(KV_EVENT_ISSUES, "KV event feed problems by kind (resyncs after a sequence "
                                       "gap or a restart, malformed batches).", ["kind"], registry=r)  # fmt: skip
        self.kv_events_stale = Gauge(KV_EVENTS_STALE, "1 while a replica's KV events are stale (routing falls "
                                     "back to the approximate prefix policy).", ["replica"], registry=r)  # fmt: skip
        self.kv_event_batches = Gauge(KV_EVENT_BATCHES, "KV event batches applied per replica.", ["replica"],
                                      registry=r)  # fmt: skip
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
