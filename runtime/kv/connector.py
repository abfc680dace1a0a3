"""The engine's side of the KV tiers: what to offload, what to load, what to announce, and when.

What it is: :class:`KVConnector`, owned by the KV cache manager and driven from the engine
thread. The manager tells it when a primary block is registered (``on_cached``) or evicted
(``on_evicted``); the scheduler's admission asks it for the blocks after the primary cache's
prefix run (``match``: the longest run the host tier holds, pinned). Around each forward the
engine calls :meth:`before_forward` (copy this step's evicted blocks out before anything
overwrites them, then write the matched blocks in) and :meth:`after_forward` (copy out the
newly computed blocks the shared tier should have, publish the step's KV events). Copies out
are queued to a worker thread (a bounded queue: a full one drops the store and counts it),
which fills the host tier, the disk tier below it and the shared server, so the step never
waits on them. Requests that may find blocks on disk or in the shared tier are prefetched by
a second worker before they are scheduled (``start_prefetch``): the blocks land in the host
tier, and the request is admitted once the fetch is done or failed; a dead shared server
costs it one timeout. A decode request whose prompt was prefilled on another replica
(``--kv-transfer-config``, ``remote_prefill.py``) waits the same way while its blocks are pulled
from that replica into the host tier (``start_remote_pull``); the CPU time the engine thread then
spends loading those blocks into the cache is the pull's too (``remote_prefill.CPU_STAGES``: "load").

Which requests use which tier: every request with a prefix-cache salt uses the host and disk
tiers; the shared tier and KV events' precise routing cover requests whose hash chain means
the same on every replica (no LoRA adapter: adapter salts are process-local ids).

What it is not: storage (``host_tier.py``, ``shared_tier.py``) or the wire form (``transfer.py``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plimsoll.runtime.kv.blocks import BlockIdentity, event_hash
from plimsoll.runtime.kv.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    ZmqEventPublisher,
)
from plimsoll.runtime.kv.host_tier import HostTier
from plimsoll.runtime.kv.shared_tier import SharedTier
from plimsoll.runtime.kv.shared_url import redacted_url
from plimsoll.runtime.kv.transfer import export_blocks, import_blocks, payload_of

if TYPE_CHECKING:
    from plimsoll.runtime.engine.kv_cache_manager import KVCacheManager
    from plimsoll.runtime.engine.request import Request
    from plimsoll.runtime.kv.remote_prefill import RemotePrefill, RemoteSource

log = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TierCounters:
    """Cumulative figures per tier (medium), read by the metrics collector at scrape time."""

    queries: dict[str, int] = field(default_factory=dict)  # tokens looked up beyond the primary cache
    hits: dict[str, int] = field(default_factory=dict)  # tokens served from each tier
    load_bytes: dict[str, int] = field(default_factory=dict)  # into the primary cache
    load_seconds: dict[str, float] = field(default_factory=dict)
    store_bytes: dict[str, int] = field(default_factory=dict)  # out of the primary cache
    store_seconds: dict[str, float] = field(default_factory=dict)
    stores_dropped: dict[str, int] = field(default_factory=dict)
    prefetch_waits: list[float] = field(default_factory=list)

    def add(self, table: str, medium: str, value: float) -> None:
        d: dict[str, Any] = getattr(self, table)
        d[medium] = d.get(medium, 0) + value


def is_portable(req: Request) -> bool:
    """Whether the request's block hashes mean the same on every replica (shared tier, router index)."""
    return req.cache_salt is not None and req.lora is None


class KVConnector:
    def __init__(
        self,
        identity: BlockIdentity,
        block_size: int,
        host: HostTier | None = None,
        shared: SharedTier | None = None,
        publisher: ZmqEventPublisher | None = None,
        queue_size: int = 64,
        shared_known_size: int = 200_000,
        offload_evictions: bool = True,
    ) -> None:
        self.identity = identity
        # False when the host tier is only where pulled blocks are staged (no --kv-offloading-size).
        self.offload_evictions = offload_evictions
        # Prefill/decode disaggregation (--kv-transfer-config): set by build_connector.
        self.remote: RemotePrefill | None = None
        self.block_size = block_size
        self.host = host
        self.shared = shared
        self.publisher = publisher
        self.counters = TierCounters()
        self._events: list[KVEvent] = []
        self._events_lock = threading.Lock()
        self._evicted: list[tuple[int, bytes]] = []
        self._computed: list[tuple[int, bytes]] = []
        self._loads: list[tuple[int, int]] = []  # (primary block id, host slot)
        self._matched: dict[
            str, tuple[list[int], list[bytes]]
        ] = {}  # request id -> (pinned slots, addresses)
        self._origin: OrderedDict[bytes, str] = OrderedDict()  # prefetched address -> tier it came from
        self._shared_known: OrderedDict[bytes, None] = OrderedDict()  # written to / read from the server
        self._shared_known_size = shared_known_size
        self._lock = threading.Lock()
        self._prefetches: dict[str, threading.Event] = {}
        # Requests whose blocks a pull brought, until their load (bounded: a request may never load them).
        self._pulled: OrderedDict[str, None] = OrderedDict()
        self._pulled_loads: list[int] = []  # this step's loads that a pull brought: blocks per request
        self._prefetch_started: dict[str, float] = {}
        self._store_queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=queue_size)
        self._prefetch_queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.prefetch_done = threading.Condition()
        self._threads = []
        if host is not None or shared is not None:
            self._threads.append(
                threading.Thread(target=self._work, args=(self._store_queue,), name="kv-store", daemon=True)
            )
        if shared is not None or (host is not None and host.disk is not None):
            self._threads.append(
                threading.Thread(
                    target=self._work, args=(self._prefetch_queue,), name="kv-prefetch", daemon=True
                )
            )
        for t in self._threads:
            t.start()
        if host is not None:
            host.listener = self._on_tier_change
            if host.disk is not None:
                host.disk.listener = self._on_tier_change
        if publisher is not None:
            log.info("publishing KV events on %s", publisher.bound_endpoint)
            # A (re)started engine holds nothing: subscribers drop what they knew of this replica.
            self._emit(AllBlocksCleared())
            self.flush_events()

    # -- events -----------------------------------------------------------------------------

    def _emit(self, event: KVEvent) -> None:
        if self.publisher is None:
            return
        with self._events_lock:
            self._events.append(event)

    def _on_tier_change(self, medium: str, address: bytes, stored: bool) -> None:
        """Host/disk tier listener (any thread): announce the block in or out of that tier."""
        h = event_hash(address[16:])
        if stored:
            self._emit(BlockStored([h], None, [], self.block_size, None, medium))
        else:
            self._emit(BlockRemoved([h], medium))

    def flush_events(self) -> None:
        if self.publisher is None:
            return
        with self._events_lock:
            events, self._events = self._events, []
        self.publisher.publish(events)

    # -- hooks from the KV cache manager (engine thread) ----------------------------------------

    def on_cached(self, req: Request, index: int, block_id: int, loaded: bool) -> None:
        """Block ``index`` of ``req`` was registered in the primary cache under its chained hash."""
        chain = req.block_hashes[index]
        if self.publisher is not None:
            parent = event_hash(req.block_hashes[index - 1]) if index else None
            bs = self.block_size
            lora = req.lora
            self._emit(BlockStored(
                [event_hash(chain)], parent, req.all_token_ids[index * bs : (index + 1) * bs], bs,
                lora.lora_int_id if lora is not None else None, MEDIUM_GPU,
                lora.lora_name if lora is not None else None,
            ))  # fmt: skip
        if self.shared is not None and not loaded and is_portable(req):
            address = self.identity.address(chain)
            with self._lock:
                known = address in self._shared_known
            if not known:
                self._computed.append((block_id, address))

    def on_evicted(self, block_id: int, chain_hash: bytes) -> None:
        """A cached primary block is about to be reused: offer its contents to the host tier."""
        self._emit(BlockRemoved([event_hash(chain_hash)], MEDIUM_GPU))
        if self.host is not None and self.offload_evictions:
            self._evicted.append((block_id, self.identity.address(chain_hash)))

    def on_cleared(self) -> None:
        self._emit(AllBlocksCleared())

    def match(self, req: Request, first: int, last: int) -> int:
        """Pin the host tier's run of ``req``'s blocks ``first .. last - 1``; how many it holds."""
        self.release(req)
        if self.host is None or req.cache_salt is None or first >= last:
            return 0
        addresses = [self.identity.address(h) for h in req.block_hashes[first:last]]
        self.host.record_lookup(addresses)
        slots = self.host.pin_run(addresses)
        self._matched[req.request_id] = (slots, addresses)
        return len(slots)

    def release(self, req: Request) -> None:
        """Unpin a match that was not used (the allocation failed, or a new match replaces it)."""
        slots, _ = self._matched.pop(req.request_id, ([], []))
        if slots and self.host is not None:
            self.host.unpin(slots)

    def take_match(self, req: Request, block_ids: list[int]) -> None:
        """The match of ``req`` goes into ``block_ids`` (newly allocated) before the next forward."""
        slots, addresses = self._matched.pop(req.request_id, ([], []))
        assert len(slots) == len(block_ids), "a match is loaded into exactly as many new blocks"
        self._loads.extend(zip(block_ids, slots, strict=True))
        if req.request_id in self._pulled:
            del self._pulled[req.request_id]
            self._pulled_loads.append(len(block_ids))
        if self.host is None or not addresses:
            return
        bs = self.block_size
        self.counters.add("queries", self.host.medium, len(addresses) * bs)
        with self._lock:
            for a in addresses[: len(slots)]:
                self.counters.add("hits", self._origin.pop(a, self.host.medium), bs)

    # -- around the forward (engine thread) -------------------------------------------------------

    def before_forward(self, kv_caches: KVCaches) -> None:
        if self._evicted:
            self._offload(kv_caches)
        if self._loads:
            assert self.host is not None
            loads, self._loads = self._loads, []
            pulled, self._pulled_loads = self._pulled_loads, []
            t0, cpu_start = time.monotonic(), time.thread_time()
            block_ids = [b for b, _ in loads]
            slots = [s for _, s in loads]
            data = self.host.read(slots)
            import_blocks(kv_caches, block_ids, data)
            self.host.unpin(slots)
            self.counters.add("load_bytes", self.host.medium, data.numel() * data.element_size())
            self.counters.add("load_seconds", self.host.medium, time.monotonic() - t0)
            if pulled and self.remote is not None:
                # One copy loads every request's blocks: each pulled request is charged its blocks' share.
                cpu = time.thread_time() - cpu_start
                for n in pulled:
                    self.remote.counters.cpu("load", cpu * n / len(loads))

    def after_forward(self, kv_caches: KVCaches) -> None:
        if self._computed:
            computed, self._computed = self._computed, []
            data = export_blocks(kv_caches, [b for b, _ in computed])
            addresses = [a for _, a in computed]
            with self._lock:
                for a in addresses:
                    self._remember_shared(a)
            self._queue_store(lambda: self._write_shared(addresses, data), "SHARED")
        self.flush_events()

    def _offload(self, kv_caches: KVCaches) -> None:
        """Copy this step's evicted blocks out (before the forward overwrites them) and queue the store."""
        assert self.host is not None
        evicted, self._evicted = self._evicted, []
        fresh = [(b, a) for b, a in evicted if a not in self.host and self.host.admits(a)]
        self.host.stores_skipped += len(evicted) - len(fresh) if self.host.store_threshold >= 2 else 0
        if not fresh:
            return
        t0 = time.monotonic()
        data = export_blocks(kv_caches, [b for b, _ in fresh])
        self.counters.add("store_seconds", self.host.medium, time.monotonic() - t0)
        addresses = [a for _, a in fresh]
        self._queue_store(lambda: self._store_host(addresses, data), self.host.medium)

    def _queue_store(self, job: Callable[[], None], medium: str) -> None:
        try:
            self._store_queue.put_nowait(job)
        except queue.Full:
            self.counters.add("stores_dropped", medium, 1)

    def _store_host(self, addresses: list[bytes], data: torch.Tensor) -> None:
        assert self.host is not None
        stored = sum(self.host.store(a, data[i]) for i, a in enumerate(addresses))
        self.counters.add("store_bytes", self.host.medium, stored * self.host.block_nbytes)

    def _write_shared(self, addresses: list[bytes], data: torch.Tensor) -> None:
        assert self.shared is not None
        t0 = time.monotonic()
        self.shared.put_many([(a, payload_of(data[i])) for i, a in enumerate(addresses)])
        self.counters.add("store_seconds", self.shared.medium, time.monotonic() - t0)
        self.counters.add("store_bytes", self.shared.medium, int(data.numel() * data.element_size()))

    def _remember_shared(self, address: bytes) -> None:
        """Note an address the server holds (caller holds ``_lock``)."""
        known = self._shared_known
        known[address] = None
        known.move_to_end(address)
        while len(known) > self._shared_known_size:
            known.popitem(last=False)

    # -- prefetch from disk and the shared tier -------------------------------------------------

    def wants_prefetch(self) -> bool:
        return self.host is not None and (self.shared is not None or self.host.disk is not None)

    def start_prefetch(self, req: Request, in_primary: Callable[[bytes], bool]) -> bool:
        """Fetch ``req``'s blocks beyond the primary cache and the host tier into the host tier.

        Returns False when there is nothing to fetch (the request may be scheduled at once).
        """
        if not self.wants_prefetch() or req.cache_salt is None:
            return False
        assert self.host is not None
        limit = (req.num_tokens - 1) // self.block_size
        hashes = req.block_hashes[:limit]
        i = 0
        while i < len(hashes) and in_primary(hashes[i]):
            i += 1
        addresses = [self.identity.address(h) for h in hashes[i:]]
        j = 0
        while j < len(addresses) and addresses[j] in self.host:
            j += 1
        rest = addresses[j:]
        if not rest:
            return False
        use_shared = self.shared is not None and is_portable(req)
        on_disk = self.host.disk is not None and rest[0] in self.host.disk
        if not use_shared and not on_disk:
            return False
        done = threading.Event()
        self._prefetches[req.request_id] = done
        self._prefetch_started[req.request_id] = time.monotonic()
        self._prefetch_queue.put(lambda: self._prefetch(rest, use_shared, done))
        return True

    def start_remote_pull(
        self, req: Request, source: RemoteSource, in_primary: Callable[[bytes], bool]
    ) -> bool:
        """Pull ``req``'s blocks prefilled on another replica into the host tier; False: schedule it now."""
        assert self.remote is not None
        done = threading.Event()
        if not self.remote.start_pull(req, source, in_primary, lambda: self._fetch_done(done)):
            return False
        self._pulled[req.request_id] = None
        while len(self._pulled) > 4096:
            self._pulled.popitem(last=False)
        self._prefetches[req.request_id] = done
        self._prefetch_started[req.request_id] = time.monotonic()
        return True

    def prefetch_ready(self, request_id: str) -> bool:
        done = self._prefetches.get(request_id)
        if done is None or done.is_set():
            self._prefetches.pop(request_id, None)
            started = self._prefetch_started.pop(request_id, None)
            if started is not None:
                self.counters.prefetch_waits.append(time.monotonic() - started)
            return True
        return False

    def cancel_prefetch(self, request_id: str) -> None:
        self._pulled.pop(request_id, None)
        self._prefetches.pop(request_id, None)
        self._prefetch_started.pop(request_id, None)

    def _prefetch(self, addresses: list[bytes], use_shared: bool, done: threading.Event) -> None:
        host = self.host
        assert host is not None
        try:
            i = 0
            for a in addresses:
                if a in host:
                    i += 1
                    continue
                if host.disk is not None and a in host.disk:
                    t0 = time.monotonic()
                    if host.load_from_disk(a):
                        self._note_origin(a, "DISK")
                        self.counters.add("load_seconds", "DISK", time.monotonic() - t0)
                        self.counters.add("load_bytes", "DISK", host.block_nbytes)
                        i += 1
                        continue
                break
            rest = addresses[i:]
            if use_shared and rest and self.shared is not None:
                self.counters.add("queries", self.shared.medium, len(rest) * self.block_size)
                t0 = time.monotonic()
                payloads = self.shared.get_run(rest)
                for a, p in zip(rest, payloads, strict=False):
                    if host.store(a, p, gate=False):
                        self._note_origin(a, self.shared.medium)
                if payloads:
                    self.counters.add("load_seconds", self.shared.medium, time.monotonic() - t0)
                    self.counters.add("load_bytes", self.shared.medium, sum(len(p) for p in payloads))
                    with self._lock:
                        for a in rest[: len(payloads)]:
                            self._remember_shared(a)
        finally:
            self._fetch_done(done)

    def _fetch_done(self, done: threading.Event) -> None:
        done.set()
        with self.prefetch_done:
            self.prefetch_done.notify_all()

    def _note_origin(self, address: bytes, medium: str) -> None:
        with self._lock:
            self._origin[address] = medium
            while len(self._origin) > 100_000:
                self._origin.popitem(last=False)

    def wait_prefetch(self, timeout_s: float) -> None:
        """Block the engine thread briefly while only prefetching requests are left (no busy loop)."""
        with self.prefetch_done:
            if any(not e.is_set() for e in self._prefetches.values()):
                self.prefetch_done.wait(timeout_s)

    # -- lifecycle ---------------------------------------------------------------------------

    def _work(self, jobs: queue.Queue[Callable[[], None] | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a tier's failure never takes the engine down
                log.exception("KV tier job failed")
            finally:
                jobs.task_done()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until queued stores are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        for q in (self._store_queue, self._prefetch_queue):
            while q.unfinished_tasks and time.monotonic() < deadline:
                time.sleep(0.005)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        for q in (self._store_queue, self._prefetch_queue):
            q.put(None)
        for t in self._threads:
            t.join(timeout=5.0)
        if self.shared is not None:
            self.shared.close()
        if self.publisher is not None:
            self.flush_events()
            self.publisher.close()


def build_connector(
    config: Any,
    kv_caches: KVCaches,
    model: torch.nn.Module,
    hf_config: Any,
    max_model_len: int,
    kv: KVCacheManager | None = None,
) -> KVConnector | None:
    """The connector an ``EngineConfig`` asks for (tiers, events, a KV transfer), or None when it asks for none.

    ``kv`` (the engine's cache manager) is needed with ``kv_transfer_config``: a producer holds blocks in it.
    """
    from plimsoll.runtime.kv.blocks import layout_of, model_fingerprint
    from plimsoll.runtime.kv.host_tier import DiskTier
    from plimsoll.runtime.kv.transfer import block_nbytes, block_shape

    events = config.kv_events_config
    wants_events = events is not None and events.enabled
    transfer = config.kv_transfer_config
    if (
        config.kv_offloading_size is None
        and config.kv_shared_url is None
        and not wants_events
        and transfer is None
    ):
        return None
    k = kv_caches[0][0]
    kv_dtype = "int8" if config.kv_cache_dtype == "int8" else config.dtype
    identity = BlockIdentity(
        model_fingerprint(hf_config.to_json_string(), list(model.state_dict().items())),
        kv_dtype,
        layout_of(len(kv_caches), k.shape[1], k.shape[2], k.shape[3]),
    )
    shape, nbytes = block_shape(kv_caches), block_nbytes(kv_caches)
    host = None
    size_gib = config.kv_offloading_size
    if size_gib is None and (
        config.kv_shared_url is not None or (transfer is not None and transfer.is_consumer)
    ):
        # The shared tier and KV pulls stage fetched blocks in host memory: room for four longest prompts.
        size_gib = 4 * -(-max_model_len // config.block_size) * nbytes / 2**30
    if size_gib is not None:
        disk = None
        if config.kv_offloading_disk_path is not None:
            disk = DiskTier(
                config.kv_offloading_disk_path, int(config.kv_offloading_disk_size * 2**30 // nbytes)
            )
        host = HostTier(
            int(size_gib * 2**30 // nbytes), shape, k.dtype, pin_memory=k.device.type == "cuda",
            store_threshold=config.kv_offloading_store_threshold, disk=disk,
        )  # fmt: skip
        log.info(
            "KV host tier: %d blocks (%.2f GiB%s)%s", host.capacity, host.capacity * nbytes / 2**30,
            ", pinned" if k.device.type == "cuda" else "",
            f"; disk tier: {disk.capacity} blocks in {disk.directory}" if disk is not None else "",
        )  # fmt: skip
    shared = None
    if config.kv_shared_url is not None:
        password = config.kv_shared_password
        shared = SharedTier(
            config.kv_shared_url, nbytes, timeout_s=config.kv_shared_timeout_s,
            password=None if password is None else password.get_secret_value(),
        )  # fmt: skip
        log.info(
            "KV shared tier: %s (timeout %.3f s%s)", redacted_url(config.kv_shared_url), config.kv_shared_timeout_s,
            ", with a password" if password is not None else "",
        )  # fmt: skip
    publisher = ZmqEventPublisher(events) if wants_events else None
    connector = KVConnector(
        identity, config.block_size, host=host, shared=shared, publisher=publisher,
        offload_evictions=config.kv_offloading_size is not None or config.kv_shared_url is not None,
    )  # fmt: skip
    if transfer is not None:
        from plimsoll.runtime.kv.remote_prefill import RemotePrefill

        assert kv is not None, "a KV transfer needs the engine's cache manager"
        try:
            connector.remote = RemotePrefill(transfer, identity, config.block_size, kv_caches, kv, host)
        except BaseException:
            connector.close()
            raise
    return connector
