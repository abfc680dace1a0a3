"""The hold queue: requests kept waiting while no replica is Ready (scale from zero).

What it is: a bounded FIFO of waiting requests with a deadline each. A request
that finds no ready replica (or finds others already held ahead of it) takes a
place here; when the queue is full it is refused at once with 429 and a
``Retry-After`` equal to the expected time to Ready, taken from this service's
own measured cold starts (:class:`ColdStarts`). Held requests are released in
arrival order, and no faster than the ready replicas' verified concurrency:
at most ``release_concurrency`` released-and-unfinished requests per ready
replica, the rest stay held. A request still held at its deadline is answered
503 by the proxy, saying the service is starting and how long it waited.
:meth:`HoldQueue.demand` is what the operator polls (``GET /hold``) to scale
from zero within one autoscaler tick.

What it is not: the HTTP (the proxy calls :meth:`HoldQueue.hold` and relays),
or a queue in front of busy replicas (saturated replicas get the proxy's 429).
Everything runs on one asyncio loop, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field

# The cap on how long a request may be held, whatever the cold starts say.
MAX_HOLD_S = 600.0
# Cold starts kept for the percentile: recent ones describe the current image and nodes.
KEPT_COLD_STARTS = 20


def p95(samples: Iterable[float]) -> float | None:
    """Nearest-rank 95th percentile (the value itself, no interpolation); None without samples."""
    ordered = sorted(samples)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


@dataclass
class ColdStarts:
    """Measured times from "a replica is needed" to "a replica is Ready", in seconds.

    ``samples`` come from the operator (``status.coldStart.samplesSeconds`` of the
    LLMService) or, for a router without one, from what the router itself saw:
    the first held request to the first Ready replica. ``fallback_s`` is used
    until one is measured, and is said to be a guess in every message.
    """

    fallback_s: float = 60.0
    samples: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        self.samples = [*self.samples, max(0.0, seconds)][-KEPT_COLD_STARTS:]

    def replace(self, samples: Iterable[float]) -> None:
        self.samples = [max(0.0, float(s)) for s in samples][-KEPT_COLD_STARTS:]

    @property
    def measured(self) -> bool:
        return bool(self.samples)

    @property
    def p95_s(self) -> float:
        value = p95(self.samples)
        return self.fallback_s if value is None else value

    def hold_timeout_s(self, override: float | None) -> float:
        """How long one request may be held: the override, else twice the p95, never above 600 s."""
        wanted = override if override is not None else 2.0 * self.p95_s
        return min(MAX_HOLD_S, max(1.0, wanted))

    def retry_after_s(self, waiting_for_s: float | None) -> int:
        """Expected seconds until a replica is Ready: p95 less what the current cold start already took."""
        left = self.p95_s - (waiting_for_s or 0.0)
        return max(1, math.ceil(left))


class HoldFull(Exception):
    """The hold queue is at its bound; the request is answered 429 at once."""

    def __init__(self, retry_after_s: int, message: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class HoldTimeout(Exception):
    """No replica took the request before its hold deadline; answered 503."""

    def __init__(self, waited_s: float, message: str) -> None:
        super().__init__(message)
        self.waited_s = waited_s


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[None]
    arrived: float
    priority: int = 0  # the request body's vLLM ``priority``: lower is released first


@dataclass(eq=False, repr=False)
class HoldQueue:
    """Bounded FIFO of requests waiting for a ready replica, released at the replicas' pace.

    ``ready_replicas`` returns how many replicas can take work now; the proxy's
    scraper and discovery call :meth:`pump` whenever that may have changed, and
    every released request calls :meth:`done` when its response ends.
    """

    capacity: int
    ready_replicas: Callable[[], int]
    cold_starts: ColdStarts
    _: KW_ONLY
    release_concurrency: int | None = None
    timeout_override_s: float | None = None
    # A router without an operator measures the cold starts itself (first held request -> Ready).
    record_cold_starts: bool = False
    clock: Callable[[], float] = time.monotonic
    # The most requests ever held at once (tests and /hold read it).
    max_held: int = field(default=0, init=False)
    max_released_in_flight: int = field(default=0, init=False)
    released_total: int = field(default=0, init=False)
    timed_out_total: int = field(default=0, init=False)
    rejected_total: int = field(default=0, init=False)
    _waiters: deque[_Waiter] = field(default_factory=deque, init=False)
    _released_in_flight: int = field(default=0, init=False)
    # When the current stretch without a ready replica began to matter (first held request).
    _needed_since: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError(f"hold queue capacity must be >= 0, got {self.capacity}")

    # ---- state -------------------------------------------------------------

    @property
    def held(self) -> int:
        return len(self._waiters)

    @property
    def released_in_flight(self) -> int:
        return self._released_in_flight

    def should_hold(self) -> bool:
        """A new request queues when nothing is ready, or when others are held ahead of it (FIFO)."""
        return self.capacity > 0 and (self.ready_replicas() == 0 or bool(self._waiters))

    def timeout_s(self) -> float:
        return self.cold_starts.hold_timeout_s(self.timeout_override_s)

    def demand(self) -> dict[str, object]:
        """What ``GET /hold`` answers: the operator scales from zero when ``held`` > 0."""
        now = self.clock()
        oldest = now - self._waiters[0].arrived if self._waiters else None
        return {
            "held": self.held,
            "capacity": self.capacity,
            "maxHeld": self.max_held,
            "oldestHeldSeconds": None if oldest is None else round(oldest, 3),
            "neededForSeconds": None if self._needed_since is None else round(now - self._needed_since, 3),
            "releasedInFlight": self._released_in_flight,
            "releaseConcurrency": self.release_concurrency,
            "holdTimeoutSeconds": self.timeout_s(),
            "coldStartP95Seconds": self.cold_starts.p95_s,
            "coldStartMeasured": self.cold_starts.measured,
            "releasedTotal": self.released_total,
            "timedOutTotal": self.timed_out_total,
            "rejectedTotal": self.rejected_total,
        }

    # ---- the request's side --------------------------------------------------

    async def hold(self, priority: int = 0) -> float:
        """Wait for a release; return the seconds held. Raises HoldFull or HoldTimeout.

        Held requests are released lowest ``priority`` first, then in arrival order.
        """
        now = self.clock()
        if self._needed_since is None and self.ready_replicas() == 0:
            self._needed_since = now
        if len(self._waiters) >= self.capacity:
            self.rejected_total += 1
            waiting_for = None if self._needed_since is None else now - self._needed_since
            retry = self.cold_starts.retry_after_s(waiting_for)
            basis = (
                f"p95 of {len(self.cold_starts.samples)} measured cold start(s) {self.cold_starts.p95_s:.0f} s"
                if self.cold_starts.measured
                else f"no cold start measured yet; assumed {self.cold_starts.fallback_s:.0f} s"
            )
            raise HoldFull(
                retry,
                f"the service is starting a replica and already holds {self.held} request(s), its limit "
                f"(router.holdQueue); retry after {retry} s ({basis})",
            )
        waiter = _Waiter(asyncio.get_running_loop().create_future(), now, priority)
        self._waiters.append(waiter)
        self.max_held = max(self.max_held, len(self._waiters))
        self.pump()
        timeout = self.timeout_s()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout=timeout)
        except TimeoutError:
            if waiter.future.done():  # released in the same instant: take it
                return self.clock() - waiter.arrived
            self._drop(waiter)
            self.timed_out_total += 1
            waited = self.clock() - waiter.arrived
            raise HoldTimeout(
                waited,
                f"the service is starting: no replica became Ready while this request was held for "
                f"{waited:.0f} s (hold limit {timeout:.0f} s = 2 × cold-start p95, at most "
                f"{MAX_HOLD_S:.0f} s); retry later",
            ) from None
        except asyncio.CancelledError:
            # The client went away while held: give the place (or the release) back.
            if waiter.future.done() and not waiter.future.cancelled():
                self.done()
            else:
                self._drop(waiter)
            raise
        return self.clock() - waiter.arrived

    def done(self) -> None:
        """A released request's response ended: its slot frees for the next held one."""
        self._released_in_flight = max(0, self._released_in_flight - 1)
        self.pump()

    # ---- the replicas' side --------------------------------------------------

    def pump(self) -> None:
        """Release held requests, best class first, while a ready replica has room for them."""
        ready = self.ready_replicas()
        if ready > 0 and self._needed_since is not None and not self._waiters:
            self._needed_since = None
        while self._waiters and ready > 0:
            if self.release_concurrency is not None and (
                self._released_in_flight >= self.release_concurrency * ready
            ):
                return
            waiter = min(self._waiters, key=lambda w: (w.priority, w.arrived))  # stable: min keeps FIFO on ties
            self._waiters.remove(waiter)
            if waiter.future.done():
                continue
            if self._needed_since is not None:
                if self.record_cold_starts:
                    self.cold_starts.add(self.clock() - self._needed_since)
                self._needed_since = None
            self._released_in_flight += 1
            self.max_released_in_flight = max(self.max_released_in_flight, self._released_in_flight)
            self.released_total += 1
            waiter.future.set_result(None)

    def _drop(self, waiter: _Waiter) -> None:
        with contextlib.suppress(ValueError):  # already released or dropped
            self._waiters.remove(waiter)
        if not waiter.future.done():
            waiter.future.cancel()
