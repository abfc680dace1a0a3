"""The KV tiers' Prometheus series, read from the engine's connector at scrape time.

What it is: a collector over :class:`plimsoll.runtime.kv.connector.KVConnector`'s cumulative
counters (hits, queries, bytes and seconds per tier, drops, shared-tier rejections, errors,
the circuit breaker, KV events), registered into the server's registry once the engine runs.
Names and meanings follow vLLM's where vLLM has them (see :mod:`plimsoll.metric_names`).
What it is not: the counting itself (the connector counts on the engine thread and its workers).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from plimsoll import metric_names as mn


class _Buckets:
    """A histogram fed from drained samples (the connector keeps raw lists)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def add(self, samples: list[float]) -> None:
        while samples:
            value = samples.pop()
            self.counts[bisect_left(self.bounds, value)] += 1
            self.sum += value

    def family(self, name: str, doc: str, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        h = HistogramMetricFamily(name, doc, labels=labels)
        self.add_to(h, values)
        return h

    def add_to(self, h: HistogramMetricFamily, values: list[str]) -> None:
        """This histogram as one series (label ``values``) of ``h``."""
        cumulative, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += count
            cumulative.append((bound, running))
        h.add_metric(values, cumulative, self.sum)


class KVTierCollector(Collector):
    def __init__(self, connector: Any, model_name: str) -> None:
        self.connector = connector
        self.model = model_name
        self.read_latency = _Buckets(mn.KV_TIER_LATENCY_BUCKETS)
        self.prefetch_wait = _Buckets(mn.KV_TIER_LATENCY_BUCKETS)
        self.transfer_time = _Buckets(mn.KV_TRANSFER_TIME_BUCKETS)
        self.transfer_cpu: dict[str, _Buckets] = {}  # by stage

    def collect(self) -> Iterator[Any]:
        c = self.connector
        yield from self._transfer(getattr(c, "remote", None))
        labels = ["model_name", "medium"]
        if c is None:
            # No tiers or events on this replica: every family exists (dashboards query them), no samples.
            yield from _empty_families()
            return
        counters = c.counters

        def per_medium(name: str, doc: str, table: dict[str, float]) -> CounterMetricFamily:
            fam = CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
            for medium, value in sorted(table.items()):
                fam.add_metric([self.model, medium], value)
            return fam

        def plain(name: str, doc: str, value: float) -> CounterMetricFamily:
            fam = CounterMetricFamily(name.removesuffix("_total"), doc, labels=["model_name"])
            fam.add_metric([self.model], value)
            return fam

        host_queries = counters.queries.get("CPU", 0)
        yield plain(mn.EXTERNAL_PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the KV tiers beyond the primary "
                    "cache (vllm:external_prefix_cache_queries).", host_queries)  # fmt: skip
        yield plain(mn.EXTERNAL_PREFIX_CACHE_HITS, "Prompt tokens loaded from a KV tier instead of recomputed "
                    "(vllm:external_prefix_cache_hits).", sum(counters.hits.values()))  # fmt: skip
        yield per_medium(mn.KV_TIER_QUERIES, "Prompt tokens looked up in each KV tier.", counters.queries)
        yield per_medium(mn.KV_TIER_HITS, "Prompt tokens served from each KV tier (by where they came from).",
                         counters.hits)  # fmt: skip
        yield per_medium(mn.KV_OFFLOAD_LOAD_BYTES, "Bytes loaded from a tier toward the primary cache "
                         "(vllm:kv_offload_load_bytes).", counters.load_bytes)  # fmt: skip
        yield per_medium(mn.KV_OFFLOAD_LOAD_TIME, "Seconds spent loading from a tier (vllm:kv_offload_load_time).",
                         counters.load_seconds)  # fmt: skip
        yield per_medium(mn.KV_OFFLOAD_STORE_BYTES, "Bytes stored from the primary cache into a tier "
                         "(vllm:kv_offload_store_bytes).", counters.store_bytes)  # fmt: skip
        yield per_medium(mn.KV_OFFLOAD_STORE_TIME, "Seconds spent storing into a tier (vllm:kv_offload_store_time).",
                         counters.store_seconds)  # fmt: skip
        yield per_medium(mn.KV_OFFLOAD_STORES_DROPPED, "Stores dropped because the store queue was full.",
                         counters.stores_dropped)  # fmt: skip
        self.prefetch_wait.add(counters.prefetch_waits)
        yield self.prefetch_wait.family(mn.KV_PREFETCH_WAIT, "Time a request waited for its blocks from disk or the "
                                        "shared tier before it was scheduled.", ["model_name"], [self.model])  # fmt: skip
        blocks = GaugeMetricFamily(mn.KV_TIER_BLOCKS, "Blocks held in each local KV tier.", labels=labels)
        capacity = GaugeMetricFamily(mn.KV_TIER_CAPACITY_BLOCKS, "Capacity of each local KV tier, in blocks.",
                                     labels=labels)  # fmt: skip
        host = c.host
        if host is not None:
            blocks.add_metric([self.model, host.medium], len(host))
            capacity.add_metric([self.model, host.medium], host.capacity)
            yield plain(mn.KV_OFFLOAD_STORES_SKIPPED, "Evicted blocks not stored: below the reuse threshold.",
                        host.stores_skipped)  # fmt: skip
            if host.disk is not None:
                blocks.add_metric([self.model, host.disk.medium], len(host.disk.index))
                capacity.add_metric([self.model, host.disk.medium], host.disk.capacity)
        yield blocks
        yield capacity
        shared = c.shared
        if shared is not None:
            s = shared.stats
            yield plain(mn.KV_SHARED_REJECTED_BLOCKS, "Shared-tier blocks that failed their check (corrupt or "
                        "foreign) and were recomputed.", s.rejected)  # fmt: skip
            yield plain(
                mn.KV_SHARED_ERRORS, "Shared-tier calls that failed (timeout, refused, protocol).", s.errors
            )
            yield plain(
                mn.KV_SHARED_SKIPPED, "Shared-tier calls not made because the circuit was open.", s.skipped
            )
            g = GaugeMetricFamily(mn.KV_SHARED_CIRCUIT_OPEN, "1 while the shared tier's circuit is open.",
                                  labels=["model_name"])  # fmt: skip
            g.add_metric([self.model], 0.0 if shared.breaker.state == "closed" else 1.0)
            yield g
            with shared.stats_lock:
                self.read_latency.add(s.read_latencies)
            yield self.read_latency.family(mn.KV_SHARED_READ_LATENCY, "Latency of one shared-tier read (MGET).",
                                           ["model_name"], [self.model])  # fmt: skip
        pub = c.publisher
        if pub is not None:
            yield plain(
                mn.KV_EVENTS_PUBLISHED, "KV event batches published (vLLM's ZMQ schema).", pub.published
            )
            yield plain(mn.KV_EVENTS_DROPPED, "KV event batches dropped (publisher queue full).", pub.dropped)

    def _transfer(self, remote: Any) -> Iterator[Any]:
        """The KV transfer's series (prefill/decode disaggregation); empty families without one."""
        m = [self.model]
        holds = CounterMetricFamily(mn.KV_TRANSFER_HOLDS.removesuffix("_total"), "Prefills whose prompt blocks "
                                    "were held for a decode replica's pull.", labels=["model_name"])  # fmt: skip
        expired = CounterMetricFamily(mn.KV_TRANSFER_EXPIRED.removesuffix("_total"), "Holds freed after "
                                      "abort_request_timeout, never pulled (vllm:nixl_num_kv_expired_reqs).",
                                      labels=["model_name"])  # fmt: skip
        held = GaugeMetricFamily(
            mn.KV_TRANSFER_HELD_BLOCKS, "Blocks held for pulls right now.", labels=["model_name"]
        )
        pulls = CounterMetricFamily(mn.KV_TRANSFER_PULLS.removesuffix("_total"), "Pulls of a remote prefill's "
                                    "blocks that brought what they asked for.", labels=["model_name"])  # fmt: skip
        failures = CounterMetricFamily(mn.KV_TRANSFER_FAILURES.removesuffix("_total"), "Pulls that failed, the "
                                       "rest prefilled locally (vllm:nixl_num_failed_transfers).",
                                       labels=["model_name", "reason"])  # fmt: skip
        blocks = CounterMetricFamily(mn.KV_TRANSFER_BLOCKS.removesuffix("_total"), "Blocks sent, received, and "
                                     "not pulled because this replica held them.", labels=["model_name", "direction"])  # fmt: skip
        nbytes = CounterMetricFamily(mn.KV_TRANSFER_BYTES.removesuffix("_total"), "KV payload bytes moved "
                                     "(vllm:nixl_bytes_transferred).", labels=["model_name", "direction"])  # fmt: skip
        if remote is None:
            yield from (holds, expired, held, pulls, failures, blocks, nbytes)
            yield HistogramMetricFamily(
                mn.KV_TRANSFER_TIME, "No KV transfer on this replica.", labels=["model_name"]
            )
            yield HistogramMetricFamily(mn.KV_TRANSFER_CPU, "No KV transfer on this replica.",
                                        labels=["model_name", "side", "stage", "thread"])  # fmt: skip
            return
        k = remote.counters
        holds.add_metric(m, k.holds)
        expired.add_metric(m, k.expired)
        held.add_metric(m, remote.held_blocks)
        pulls.add_metric(m, k.pulls)
        for reason, n in sorted(k.failures.items()):
            failures.add_metric([self.model, reason], n)
        for direction, n in (
            ("sent", k.blocks_sent),
            ("received", k.blocks_received),
            ("skipped", k.blocks_skipped),
        ):
            blocks.add_metric([self.model, direction], n)
        for direction, n in (("sent", k.bytes_sent), ("received", k.bytes_received)):
            nbytes.add_metric([self.model, direction], n)
        yield from (holds, expired, held, pulls, failures, blocks, nbytes)
        self.transfer_time.add(k.pull_seconds)
        yield self.transfer_time.family(mn.KV_TRANSFER_TIME, "One pull of a remote prefill's blocks, connect to the "
                                        "last block staged (vllm:nixl_xfer_time_seconds).", ["model_name"], m)  # fmt: skip
        yield self._transfer_cpu(remote)

    def _transfer_cpu(self, remote: Any) -> HistogramMetricFamily:
        """One request's transfer CPU time per stage: one histogram family, a series per stage."""
        from plimsoll.runtime.kv.remote_prefill import CPU_STAGES

        fam = HistogramMetricFamily(mn.KV_TRANSFER_CPU, "Thread CPU time one request's KV transfer took in each "
                                    "stage, on the thread that did the work (the producer's side for the blocks it "
                                    "sent, the consumer's for those it pulled and loaded).",
                                    labels=["model_name", "side", "stage", "thread"])  # fmt: skip
        for stage, (side, thread) in CPU_STAGES.items():
            buckets = self.transfer_cpu.setdefault(stage, _Buckets(mn.KV_TRANSFER_CPU_BUCKETS))
            buckets.add(remote.counters.cpu_samples[stage])
            buckets.add_to(fam, [self.model, side, stage, thread])
        return fam


def _empty_families() -> Iterator[Any]:
    doc = "KV tiers and events are off on this replica (runtime/kv/)."
    per_medium = (mn.KV_TIER_QUERIES, mn.KV_TIER_HITS, mn.KV_OFFLOAD_LOAD_BYTES, mn.KV_OFFLOAD_LOAD_TIME,
                  mn.KV_OFFLOAD_STORE_BYTES, mn.KV_OFFLOAD_STORE_TIME, mn.KV_OFFLOAD_STORES_DROPPED)  # fmt: skip
    plain = (mn.EXTERNAL_PREFIX_CACHE_QUERIES, mn.EXTERNAL_PREFIX_CACHE_HITS, mn.KV_OFFLOAD_STORES_SKIPPED,
             mn.KV_SHARED_REJECTED_BLOCKS, mn.KV_SHARED_ERRORS, mn.KV_SHARED_SKIPPED, mn.KV_EVENTS_PUBLISHED,
             mn.KV_EVENTS_DROPPED)  # fmt: skip
    for name in per_medium:
        yield CounterMetricFamily(name.removesuffix("_total"), doc, labels=["model_name", "medium"])
    for name in plain:
        yield CounterMetricFamily(name.removesuffix("_total"), doc, labels=["model_name"])
    for name in (mn.KV_TIER_BLOCKS, mn.KV_TIER_CAPACITY_BLOCKS):
        yield GaugeMetricFamily(name, doc, labels=["model_name", "medium"])
    yield GaugeMetricFamily(mn.KV_SHARED_CIRCUIT_OPEN, doc, labels=["model_name"])
    for name in (mn.KV_SHARED_READ_LATENCY, mn.KV_PREFETCH_WAIT):
        yield HistogramMetricFamily(name, doc, labels=["model_name"])
