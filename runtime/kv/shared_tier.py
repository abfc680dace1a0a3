"""The tier shared by the replicas of one service: checked blocks in a Valkey or Redis server.

What it is: a synchronous redis-py client used only from the offload workers (never from the
engine thread), keyed by content address (``blocks.BlockIdentity.key``) so a block computed
on replica A is found by replica B. Each value is a checked block (``transfer.pack_block``):
a block that is corrupt, truncated or stored under another block's key is rejected and
counted, never served. Every call has one socket timeout and no retry, and a circuit breaker
stops calling a server that failed ``failures`` times in a row until ``cooldown_s`` passed,
so a dead server costs a request at most one timeout before it recomputes, and costs nothing
while the breaker is open. Writes are ``SET NX`` (first writer wins; equal addresses hold
equal bytes); the server's own ``maxmemory`` and LRU policy bound and evict.

What it is not: a place that decides which blocks to write (``connector.py``) or a cache
index: the server is the index.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, ClassVar, cast

from plimsoll.runtime.kv.transfer import BlockRejected, pack_block, unpack_block

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

KEY_PREFIX = "plimsoll:kv:"


class CircuitBreaker:
    """Closed → open after ``failures`` consecutive failures; one trial call after ``cooldown_s``."""

    def __init__(
        self, failures: int = 3, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.consecutive = 0
        self.opened_at: float | None = None
        self.trial_in_flight = False
        self.lock = threading.Lock()
        self.times_opened = 0

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.cooldown_s else "open"

    def allow(self) -> bool:
        with self.lock:
            if self.opened_at is None:
                return True
            if self.clock() - self.opened_at < self.cooldown_s or self.trial_in_flight:
                return False
            self.trial_in_flight = True  # half-open: exactly one call finds out
            return True

    def success(self) -> None:
        with self.lock:
            if self.opened_at is not None:
                log.info("shared KV tier reachable again; circuit closed")
            self.consecutive, self.opened_at, self.trial_in_flight = 0, None, False

    def failure(self) -> None:
        with self.lock:
            self.consecutive += 1
            self.trial_in_flight = False
            if self.opened_at is not None or self.consecutive >= self.failures:
                if self.opened_at is None:
                    self.times_opened += 1
                    log.warning(
                        "shared KV tier failed %d times in a row; circuit open for %.1f s (requests recompute)",
                        self.consecutive,
                        self.cooldown_s,
                    )
                self.opened_at = self.clock()


@dataclass
class SharedTierStats:
    hits: int = 0  # blocks served
    misses: int = 0  # blocks asked for and absent
    rejected: int = 0  # blocks present but failing their check
    errors: int = 0  # calls that failed (timeout, refused, protocol)
    skipped: int = 0  # calls not made because the circuit was open
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    read_latencies: list[float] = field(default_factory=list)  # drained by metrics


@dataclass(eq=False, repr=False)
class SharedTier:
    medium: ClassVar[str] = "SHARED"

    url: str
    payload_bytes: int
    timeout_s: float = 0.25
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    key_prefix: str = KEY_PREFIX
    max_get_blocks: int = 256
    password: InitVar[str | None] = None  # used to connect, never kept
    stats: SharedTierStats = field(default_factory=SharedTierStats, init=False)
    stats_lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    client: redis.Redis = field(init=False)
    _auth_refused_logged: bool = field(default=False, init=False)

    def __post_init__(self, password: str | None) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # One socket timeout per call and no retry: the budget a dead server may cost a request.
        self.client = redis.Redis.from_url(
            self.url,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            # A password in the URL wins (redis-py's rule); this one is for a URL without it.
            **({} if password is None else {"password": password}),
        )

    def key(self, address: bytes) -> str:
        return self.key_prefix + address.hex()

    def get_run(self, addresses: list[bytes]) -> list[bytes]:
        """Payloads of the longest leading run of ``addresses`` the server holds and that pass their check."""
        if not addresses:
            return []
        if not self.breaker.allow():
            with self.stats_lock:
                self.stats.skipped += 1
            return []
        t0 = time.monotonic()
        try:
            values = self.client.mget([self.key(a) for a in addresses[: self.max_get_blocks]])
        except Exception as exc:  # redis.RedisError, OSError: the server is the one at fault
            self._failed("read", exc)
            return []
        self.breaker.success()
        out: list[bytes] = []
        rejected = 0
        for address, blob in zip(addresses, values, strict=False):
            if blob is None:
                break
            try:
                # decode_responses is off, so redis-py hands values back as bytes (it types them bytes | str).
                out.append(unpack_block(address, cast(bytes, blob), self.payload_bytes))
            except BlockRejected as exc:
                rejected += 1
                log.warning("shared KV tier: block %s rejected (%s); recomputing", address.hex()[32:48], exc)
                break
        elapsed = time.monotonic() - t0
        with self.stats_lock:
            s = self.stats
            s.hits += len(out)
            s.misses += 1 if len(out) < len(addresses) and rejected == 0 else 0
            s.rejected += rejected
            s.bytes_read += sum(len(p) for p in out)
            s.read_seconds += elapsed
            s.read_latencies.append(elapsed)
        return out

    def put_many(self, blocks: list[tuple[bytes, bytes]]) -> int:
        """Write ``(address, payload)`` pairs (``SET NX``, one pipelined round trip); how many were new."""
        if not blocks:
            return 0
        if not self.breaker.allow():
            with self.stats_lock:
                self.stats.skipped += 1
            return 0
        t0 = time.monotonic()
        try:
            pipe = self.client.pipeline(transaction=False)
            for address, payload in blocks:
                pipe.set(self.key(address), pack_block(address, payload), nx=True)
            results = pipe.execute()
        except Exception as exc:
            self._failed("write", exc)
            return 0
        self.breaker.success()
        written = sum(1 for r in results if r)
        with self.stats_lock:
            self.stats.blocks_written += written
            self.stats.bytes_written += sum(len(p) for (_, p), r in zip(blocks, results, strict=True) if r)
            self.stats.write_seconds += time.monotonic() - t0
        return written

    def _failed(self, what: str, exc: Exception) -> None:
        with self.stats_lock:
            self.stats.errors += 1
        if _is_auth_refusal(exc) and not self._auth_refused_logged:
            # Not a passing fault: every call will fail the same way until the password is fixed.
            self._auth_refused_logged = True
            log.error(
                "the shared KV tier refused this replica (%s); every shared-tier call recomputes until "
                "--kv-shared-password / PLIMSOLL_KV_SHARED_PASSWORD matches the server's requirepass",
                exc,
            )
        log.debug("shared KV tier %s failed: %r", what, exc)
        self.breaker.failure()

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a dead connection: nothing to do
            self.client.close()


def _is_auth_refusal(exc: Exception) -> bool:
    """A missing or wrong password (NOAUTH, WRONGPASS), as opposed to a slow or dead server."""
    from redis.exceptions import AuthenticationError, ResponseError

    if isinstance(exc, AuthenticationError):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(("NOAUTH", "WRONGPASS"))
