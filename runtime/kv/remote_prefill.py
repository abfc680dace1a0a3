"""Prefill on one replica, decode on another: vLLM's ``kv_transfer_params`` protocol over the built-in transport.

What it is: :class:`RemotePrefill`, owned by the engine's KV connector when ``--kv-transfer-config``
is set. On the producer (``kv_producer``/``kv_both``) a request carrying ``{"do_remote_decode":
true}`` is prefilled as usual; when it finishes, :meth:`hold` keeps a reference on its full prompt
blocks and returns the parameters a decode replica needs (vLLM's names: ``do_remote_prefill``,
``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``, ``remote_host``,
``remote_port``); the transfer server (``transport.py``) hands those blocks to the one pull that
names them, then lets them go, and frees them anyway after ``abort_request_timeout`` seconds.
On the consumer (``kv_consumer``/``kv_both``) a request carrying those parameters is held back
from scheduling while :meth:`start_pull` fetches, on a worker, only the blocks past the longest
run this replica already holds (its primary cache, then its host tier): each block is checked
against the content address this replica's own hash chain gives it (``blocks.py``; the model,
KV dtype and layout are in the address, so a block from another model or of another prompt is
rejected) and staged in the host tier (pinned on CUDA), from where the scheduler's prefix match
loads it into the cache. Whatever the pull did not bring is prefilled locally: a dead, stalled
or forgetful producer costs one timeout, never the request.

What a transfer costs each replica's CPU is measured where it is spent, as thread CPU time
(``time.thread_time``: user and system time of the thread doing the work, so waiting on the
network costs nothing and another thread's work is not counted), per request and stage
(:data:`CPU_STAGES`): the producer's engine thread holding the blocks, its connection thread
reading, checksumming and sending them; the consumer's engine thread starting the pull and later
loading the staged blocks into its cache, its pull worker receiving, checking and staging them.
On replicas whose own cores move the blocks (CPU serving) this, not the pull's wall time, is what
the transfer takes from their prefills and decode steps. (The load's copy is a torch op: with an
OpenMP team of several threads, the team's other threads' share is not counted.)

Only full blocks move: the tail of the prompt shorter than a block (and its last token, whose
logits decode needs) is recomputed on the consumer, as a prefix-cache hit would be.

What it is not: the wire (``transport.py``), the host tier (``host_tier.py``) or the scheduler.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plimsoll.runtime.kv.blocks import BlockIdentity
from plimsoll.runtime.kv.transfer import BlockRejected, export_blocks, pack_block, payload_of, unpack_block
from plimsoll.runtime.kv.transfer_config import KVTransferConfig
from plimsoll.runtime.kv.transport import TransferError, TransferServer, request_blocks

if TYPE_CHECKING:
    from plimsoll.runtime.engine.block_pool import KVCacheBlock
    from plimsoll.runtime.engine.kv_cache_manager import KVCacheManager
    from plimsoll.runtime.engine.request import Request
    from plimsoll.runtime.kv.host_tier import HostTier

log = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
WILDCARDS = ("0.0.0.0", "::", "")
STAGING_BLOCKS = 16  # blocks one export copies through the staging buffer at a time
# Each piece of a transfer's CPU time: stage -> (side, thread it runs on). "engine" work delays the
# replica's next step directly; "transfer" work runs beside it (on a one-core replica, in its place).
CPU_STAGES: dict[str, tuple[str, str]] = {
    "hold": ("producer", "engine"),  # content addresses of the held blocks, the hold itself
    "send": ("producer", "transfer"),  # connection thread: read the blocks, checksum, send
    "start": ("consumer", "engine"),  # which blocks this replica lacks, the pull queued
    "receive": ("consumer", "transfer"),  # pull worker: receive, check each block, stage it
    "load": ("consumer", "engine"),  # the staged blocks copied into the cache before a forward
}


class RemoteDecode:
    """Marks a request as the prefill half of a split: hold its blocks for a pull when it finishes."""

    def __repr__(self) -> str:
        return "RemoteDecode()"


@dataclass(frozen=True, slots=True)
class RemoteSource:
    """Where a decode request's prefilled blocks wait: the parsed ``do_remote_prefill`` parameters."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int


@dataclass
class TransferCounters:
    """Cumulative figures read by the metrics collector at scrape time (any thread)."""

    holds: int = 0  # producer: requests whose blocks were held for a pull
    expired: int = 0  # producer: holds freed by the timeout, never pulled
    blocks_sent: int = 0
    bytes_sent: int = 0
    pulls: int = 0  # consumer: pulls that brought what they asked for
    blocks_received: int = 0
    bytes_received: int = 0
    blocks_skipped: int = 0  # consumer: blocks not pulled because this replica held them already
    failures: dict[str, int] = field(default_factory=dict)  # consumer: by reason
    pull_seconds: list[float] = field(default_factory=list)  # drained by the collector
    # Thread CPU seconds per request and stage (CPU_STAGES): samples drained by the collector, and totals.
    cpu_samples: dict[str, list[float]] = field(default_factory=lambda: {stage: [] for stage in CPU_STAGES})
    cpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CPU_STAGES, 0.0))

    def fail(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def cpu(self, stage: str, seconds: float) -> None:
        """One request's CPU time in ``stage`` (any thread: list appends and float adds under the GIL)."""
        self.cpu_samples[stage].append(seconds)
        self.cpu_seconds[stage] += seconds


@dataclass
class _Held:
    blocks: list[KVCacheBlock]
    addresses: list[bytes]
    deadline: float


class _Staging:
    """How a producer reads held blocks out of its cache, one block's bytes at a time.

    On CUDA the blocks go through a pinned host buffer on a side stream (so the copy does not wait
    on the engine's kernels; their writes finished when the request did). On CPU the bytes are read
    straight from the cache's memory with numpy: no torch op runs on a transfer thread, which would
    give it an OpenMP pool of its own beside the engine's (``async_engine.py`` says what that costs).
    ``staged=True`` runs the CUDA path on CPU (an unpinned buffer), for tests.
    """

    def __init__(self, kv_caches: KVCaches, blocks: int = STAGING_BLOCKS, staged: bool = False) -> None:
        k = kv_caches[0][0]
        self.kv_caches = kv_caches
        self.device = k.device
        self.staged = staged or self.device.type != "cpu"
        self.buffer: torch.Tensor | None = None
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.lock = threading.Lock()
        if self.staged:
            shape = (blocks, len(kv_caches), 2, *k.shape[1:])
            self.buffer = torch.empty(shape, dtype=k.dtype, pin_memory=self.device.type == "cuda")
        else:
            # [num_blocks, bytes of one layer's K (or V) block] views of each cache tensor's memory.
            self.host_views = [
                (t.view(torch.uint8).numpy().reshape(t.shape[0], -1)) for kv in kv_caches for t in kv
            ]

    def payloads(self, block_ids: list[int]) -> Iterator[bytes]:
        """Each block's bytes in ``export_blocks``' layout (layers, then K and V), in order."""
        if not self.staged:
            for b in block_ids:
                yield b"".join(view[b].tobytes() for view in self.host_views)
            return
        assert self.buffer is not None
        step = self.buffer.shape[0]
        for start in range(0, len(block_ids), step):
            chunk = block_ids[start : start + step]
            with self.lock:
                out = self.buffer[: len(chunk)]
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        export_blocks(self.kv_caches, chunk, out=out)
                    self.stream.synchronize()
                else:
                    export_blocks(self.kv_caches, chunk, out=out)
                payloads = [payload_of(out[i]) for i in range(len(chunk))]
            yield from payloads


class _Outgoing:
    """The blocks one pull asked for, as the transfer server sends them; ``close()`` ends the hold, once."""

    def __init__(self, owner: RemotePrefill, held: _Held, positions: list[int], cpu_start: float) -> None:
        self.owner, self.held, self.positions = owner, held, positions
        self.closed = False
        self.cpu_start = cpu_start  # the connection thread's CPU clock when the pull's answer began

    def __iter__(self) -> Iterator[bytes]:
        assert self.owner._staging is not None
        counters = self.owner.counters
        ids = [self.held.blocks[p].block_id for p in self.positions]
        for p, payload in zip(self.positions, self.owner._staging.payloads(ids), strict=True):
            counters.blocks_sent += 1
            counters.bytes_sent += len(payload)
            yield pack_block(self.held.addresses[p], payload)

    def close(self) -> None:
        """Sent, or the consumer went away: either way nobody pulls these blocks again."""
        if not self.closed:
            self.closed = True
            self.owner._release(self.held.blocks)
            # The transfer server calls this on the connection thread once the last block is sent.
            self.owner.counters.cpu("send", time.thread_time() - self.cpu_start)


@dataclass(eq=False, repr=False)
class RemotePrefill:
    config: KVTransferConfig
    identity: BlockIdentity
    block_size: int
    kv_caches: KVCaches
    kv: KVCacheManager
    host: HostTier | None
    counters: TransferCounters = field(default_factory=TransferCounters, init=False)
    # Called (any thread) when held blocks are ready to be freed: the async engine wakes its loop.
    wake: Callable[[], None] | None = field(default=None, init=False)
    server: TransferServer | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _held: dict[str, _Held] = field(default_factory=dict, init=False)
    _releases: list[list[KVCacheBlock]] = field(default_factory=list, init=False)
    _ids: itertools.count[int] = field(default_factory=itertools.count, init=False)
    _staging: _Staging | None = field(default=None, init=False)
    _pulls: ThreadPoolExecutor | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        config = self.config
        if config.is_producer:
            self._staging = _Staging(self.kv_caches)
            self.server = TransferServer(
                config.kv_ip, config.kv_port, self._answer, on_tick=self._expire
            ).start()
            log.info(
                "KV transfer (%s, engine %s): serving held blocks on %s:%d, held for %gs at most",
                config.kv_role, config.engine_id, config.kv_ip, self.server.port,
                config.timeouts.abort_request_timeout,
            )  # fmt: skip
        if config.is_consumer:
            assert self.host is not None, "a consumer stages pulled blocks in the host tier"
            self._pulls = ThreadPoolExecutor(config.timeouts.pull_workers, thread_name_prefix="kv-pull")
            log.info(
                "KV transfer (%s, engine %s): pulls wait %gs at most, then prefill locally",
                config.kv_role, config.engine_id, config.timeouts.transfer_timeout,
            )  # fmt: skip

    # -- parsing a request's kv_transfer_params (engine thread, at intake) ----------------------

    def parse(self, params: dict[str, Any] | None, n: int) -> RemoteDecode | RemoteSource | None:
        """What ``kv_transfer_params`` ask of this request; ``ValueError`` when this replica's role forbids it.

        Incomplete ``do_remote_prefill`` parameters are not an error (vLLM's rule): the request
        is prefilled here, and the failure is counted (``invalid``).
        """
        if not params:
            return None
        wants_decode, wants_prefill = (
            bool(params.get("do_remote_decode")),
            bool(params.get("do_remote_prefill")),
        )
        if not wants_decode and not wants_prefill:
            return None
        if n != 1:
            raise ValueError(f"kv_transfer_params move one sequence's blocks; send n=1, not n={n}")
        role = self.config.kv_role
        if wants_decode:
            if not self.config.is_producer:
                raise ValueError(
                    f"do_remote_decode asks this replica to prefill for another, but its kv_role is {role}; "
                    "send it to a kv_producer or kv_both replica"
                )
            return RemoteDecode()
        if not self.config.is_consumer:
            raise ValueError(
                f"do_remote_prefill asks this replica to decode after a remote prefill, but its kv_role is {role}; "
                "send it to a kv_consumer or kv_both replica"
            )
        try:
            source = RemoteSource(
                str(params["remote_engine_id"]), str(params["remote_request_id"]),
                tuple(int(b) for b in params.get("remote_block_ids") or ()), str(params["remote_host"]),
                int(params["remote_port"]),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("kv_transfer_params without a usable remote (%r): prefilling locally", exc)
            self.counters.fail("invalid")
            return None
        return source

    # -- producer ------------------------------------------------------------------------------

    def hold(self, req: Request) -> dict[str, Any]:
        """Keep ``req``'s full prompt blocks for a pull; the parameters the decode replica needs (engine thread)."""
        cpu_start = time.thread_time()
        bs = self.block_size
        req.update_block_hashes(bs)
        n = min(req.num_prompt_tokens // bs, len(req.block_hashes))
        blocks = self.kv.req_blocks.get(req.request_id, [])[:n]
        addresses = [self.identity.address(h) for h in req.block_hashes[: len(blocks)]]
        transfer_id = f"{req.request_id}.{next(self._ids)}"
        if blocks:
            self.kv.pool.touch(blocks)  # the request's own reference goes when it is freed; this one stays
            deadline = time.monotonic() + self.config.timeouts.abort_request_timeout
            with self._lock:
                self._held[transfer_id] = _Held(blocks, addresses, deadline)
        self.counters.holds += 1
        assert self.server is not None
        host = self.config.kv_ip
        self.counters.cpu("hold", time.thread_time() - cpu_start)
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": transfer_id,
            "remote_block_ids": [b.block_id for b in blocks],
            # A wildcard bind: the HTTP layer names the address the prefill request came in on.
            "remote_host": None if host in WILDCARDS else host,
            "remote_port": self.server.port,
            "tp_size": 1,
        }

    def _answer(self, message: dict[str, Any]) -> tuple[dict[str, Any], Iterable[bytes]]:
        """The transfer server's handler (its connection thread): the held blocks a pull names, then free them."""
        cpu_start = time.thread_time()
        op = message.get("op")
        if message.get("engine_id") != self.config.engine_id:
            return {
                "ok": False,
                "error": f"this is engine {self.config.engine_id}, not {message.get('engine_id')}",
            }, []
        with self._lock:
            held = self._held.pop(str(message.get("transfer_id")), None)
        if held is None:
            return {
                "ok": False,
                "error": "no blocks held under that id (already pulled, or freed by the timeout)",
            }, []
        if op == "release":
            self._release(held.blocks)
            return {"ok": True, "count": 0}, []
        positions = message.get("positions")
        if (
            op != "pull"
            or not isinstance(positions, list)
            or not all(isinstance(p, int) and 0 <= p < len(held.blocks) for p in positions)
        ):
            self._release(held.blocks)
            return {"ok": False, "error": f"a bad message (op {op!r}, positions {positions!r})"}, []
        return {"ok": True, "count": len(positions)}, _Outgoing(self, held, positions, cpu_start)

    def _release(self, blocks: list[KVCacheBlock]) -> None:
        with self._lock:
            self._releases.append(blocks)
        if self.wake is not None:
            self.wake()

    def _expire(self) -> None:
        """The server's tick: free holds nobody pulled within ``abort_request_timeout``."""
        now = time.monotonic()
        with self._lock:
            due = [tid for tid, h in self._held.items() if h.deadline <= now]
            expired = [self._held.pop(tid) for tid in due]
        for h in expired:
            log.info("KV transfer: %d held blocks freed, not pulled within %gs", len(h.blocks),
                     self.config.timeouts.abort_request_timeout)  # fmt: skip
            self.counters.expired += 1
            self._release(h.blocks)

    def apply_releases(self) -> None:
        """Free the blocks whose hold ended (engine thread: the block pool is its alone)."""
        with self._lock:
            releases, self._releases = self._releases, []
        for blocks in releases:
            self.kv.pool.free_blocks(blocks)

    @property
    def held_blocks(self) -> int:
        with self._lock:
            return sum(len(h.blocks) for h in self._held.values())

    @property
    def port(self) -> int | None:
        return self.server.port if self.server is not None else None

    # -- consumer ------------------------------------------------------------------------------

    def start_pull(
        self,
        req: Request,
        source: RemoteSource,
        in_primary: Callable[[bytes], bool],
        done: Callable[[], None],
    ) -> bool:
        """Fetch the blocks of ``req`` this replica lacks from ``source`` into the host tier (engine thread).

        False when nothing needs fetching (the request may be scheduled at once; the producer is told
        to let its blocks go). Otherwise ``done()`` is called from a worker once the pull ended, well
        or not.
        """
        assert self._pulls is not None and self.host is not None
        cpu_start = time.thread_time()
        bs = self.block_size
        req.update_block_hashes(bs)
        limit = min((req.num_tokens - 1) // bs, len(source.block_ids), len(req.block_hashes))
        i = 0
        while i < limit and in_primary(req.block_hashes[i]):
            i += 1
        addresses = [self.identity.address(h) for h in req.block_hashes[:limit]]
        while i < limit and addresses[i] in self.host:
            i += 1
        self.counters.blocks_skipped += i
        if i >= limit:
            self._pulls.submit(self._tell_release, source)
            return False
        self._pulls.submit(self._pull, source, list(range(i, limit)), addresses[i:limit], done)
        self.counters.cpu("start", time.thread_time() - cpu_start)
        return True

    def _pull(
        self, source: RemoteSource, positions: list[int], addresses: list[bytes], done: Callable[[], None]
    ) -> None:
        assert self.host is not None
        t0, cpu_start = time.monotonic(), time.thread_time()
        message = {"op": "pull", "transfer_id": source.request_id, "engine_id": source.engine_id,
                   "positions": positions}  # fmt: skip
        try:
            _, blobs = request_blocks(
                source.host, source.port, message, self.config.timeouts.transfer_timeout
            )
            stored = 0
            for address, blob in zip(addresses, blobs, strict=False):
                payload = unpack_block(address, blob, self.host.block_nbytes)
                if not self.host.store(address, payload, gate=False):
                    break  # every staging slot is being read: the rest is prefilled here
                stored += 1
                self.counters.bytes_received += len(payload)
            self.counters.blocks_received += stored
            if len(blobs) < len(positions):
                self.counters.fail("protocol")
            else:
                self.counters.pulls += 1
                self.counters.pull_seconds.append(time.monotonic() - t0)
        except TransferError as exc:
            log.warning("KV pull of %d blocks failed (%s); prefilling locally", len(positions), exc)
            self.counters.fail(exc.reason)
        except BlockRejected as exc:
            log.warning("KV pull from %s:%d: a block failed its check (%s); prefilling the rest locally",
                        source.host, source.port, exc)  # fmt: skip
            self.counters.fail("rejected")
        except Exception:
            log.exception("KV pull failed")
            self.counters.fail("error")
        finally:
            self.counters.cpu("receive", time.thread_time() - cpu_start)
            done()

    def _tell_release(self, source: RemoteSource) -> None:
        """Nothing to pull (this replica held the whole prompt): the producer may free its blocks now."""
        message = {"op": "release", "transfer_id": source.request_id, "engine_id": source.engine_id}
        try:
            request_blocks(source.host, source.port, message, min(2.0, self.config.timeouts.transfer_timeout))
        except TransferError as exc:
            log.debug("KV release not delivered (%s); the producer's timeout frees the blocks", exc)

    # -- lifecycle --------------------------------------------------------------------------------

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._pulls is not None:
            self._pulls.shutdown(wait=False, cancel_futures=True)
