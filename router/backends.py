"""The replica set: which replicas exist, which are ready, and how loaded each is.

What it is: plain state shared by the proxy (which counts its own in-flight
requests), the scraper (which fills in each replica's waiting/running queue and
readiness) and discovery (which adds and removes replicas), and a wait for a ready
replica. What it is not: a policy; picking a replica is
:mod:`plimsoll.router.policy`'s job, and nothing here does I/O.

Everything runs on one asyncio loop, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# When a replica counts as lost (the streams still open on it then move to another replica).
# Refused or reset probes mean nothing listens on its port: the process is gone, and two in a
# row are enough. Timed-out probes are also what a replica too busy to answer in time gives, so
# they count only once the replica has said nothing at all, neither a probe answer nor a byte
# of any stream, for LOST_SILENCE_S: its node or network is gone, or the process is frozen.
LOST_AFTER_PROBES = 2
LOST_AFTER_SILENT_PROBES = 3
LOST_SILENCE_S = 10.0


@dataclass(slots=True)
class Replica:
    """One replica as the router sees it."""

    url: str
    # Ready as the source of the replica says: always True for a static backend,
    # the pod's Ready condition when discovered from Kubernetes.
    discovered_ready: bool = True
    # Ready as the router itself last saw it: the last readiness probe succeeded
    # and no connection to it has failed since.
    reachable: bool = False
    inflight: int = 0
    # From the replica's own /metrics (None until the first successful scrape).
    waiting: float | None = None
    running: float | None = None
    engine: str | None = None
    last_scrape: float | None = None
    routed_total: int = 0
    # Marked for removal by the operator's scale-down (pod label plimsoll.dev/draining):
    # requests on it finish there, nothing new is sent.
    draining: bool = False
    # LoRA: adapters the replica serves (its /v1/models cards with a parent; None: not known or
    # LoRA off) and those with requests running or waiting there now (lora_requests_info), which
    # sit in its GPU slots, so a request for one costs no adapter swap.
    adapters: frozenset[str] | None = None
    active_adapters: frozenset[str] = frozenset()
    # Its measured capacity relative to the others (an LLMService's hardware variants: the
    # in-flight one replica of its variant carries at its target); 1.0 when all are alike.
    weight: float = 1.0
    # The requests/s one replica of its variant finishes at that target (None: not measured, or
    # all alike). Least in-flight sends replicas that have one traffic in proportion to it.
    rate: float | None = None
    # Token-aware load from the replica's /metrics (None: not exported), and the router's in-flight
    # when it was read.
    token_load: TokenLoad | None = None
    inflight_at_scrape: int = 0
    # Readiness probes in a row that got no answer (see LOST_AFTER_PROBES), whether the last was
    # refused (rather than timed out), when the replica last said anything (a probe answer or a
    # stream's byte; monotonic), whether it counts as lost now, and what to call when it is
    # found lost (each open stream on it registers one).
    probe_failures: int = 0
    last_refused: bool = False
    last_heard: float = field(default_factory=time.monotonic)
    lost: bool = False
    lost_listeners: set[Callable[[], None]] = field(default_factory=set)
    # It answered /ready 200 at least once: while it is not ready now it is away (restarting), and a
    # request waits for it (--migration-wait) rather than failing.
    seen_ready: bool = False
    # Parked asleep by the operator (pod label plimsoll.dev/standby): routed nothing, unless this router
    # woke it itself (``woken_at``, monotonic; router/standby_wake.py) because every awake replica was
    # past its target. Its pod's name (discovered replicas) is what the operator is told it woke.
    parked: bool = False
    woken_at: float | None = None
    pod: str | None = None

    @property
    def is_ready(self) -> bool:
        if not self.reachable or self.draining:
            return False
        # A replica this router woke serves before its pod turns Ready again (the kubelet's next probe)
        # and before the operator takes its standby label off.
        return self.woken_at is not None or (self.discovered_ready and not self.parked)

    @property
    def is_lost(self) -> bool:
        return self.lost

    @property
    def is_away(self) -> bool:
        """Served before, not ready now and not leaving: a restarting replica a request may wait for."""
        return self.seen_ready and not self.draining and not self.parked and not self.is_ready

    def heard(self, now: float | None = None) -> None:
        """The replica said something (a probe answer, a stream's byte): it is alive."""
        self.last_heard = time.monotonic() if now is None else now

    @property
    def relative_load(self) -> float:
        """Load per unit of capacity: what least-in-flight evens out (equal weights: the load's order)."""
        return self.load / self.weight

    @property
    def load(self) -> float:
        """Work at this replica: this router's own in-flight now, plus what the last scrape showed
        running and waiting beyond this router's in-flight at that scrape (other routers' requests).

        The replica's own numbers count every router's requests, so routers in front of the
        same replicas see each other's load without sharing anything; this router's part is its
        exact count, not the scrape's, which a second later still shows requests a closed loop has
        finished (and would send the next one past a replica with room). Before the first scrape
        only the router's own count is known.
        """
        if self.running is None and self.waiting is None:
            return float(self.inflight)
        others = max(0.0, (self.running or 0.0) + (self.waiting or 0.0) - self.inflight_at_scrape)
        return float(self.inflight) + others


@dataclass(frozen=True, slots=True)
class TokenLoad:
    """What a plimsoll replica exports for predicted-TTFT routing (``plimsoll.ttft_prediction``): its
    backlog in seconds and the prefill rate and decode step time it measured."""

    backlog_s: float
    prefill_tokens_per_s: float
    decode_step_s: float


def _set_parked(replica: Replica, parked: bool) -> None:
    """The standby label as discovered; a wake by this router is forgotten once the label is off and the
    pod is Ready (the operator took it in), or when the operator parks it again (it is asleep)."""
    if replica.woken_at is not None and not parked and replica.discovered_ready:
        replica.woken_at = None
    if parked and not replica.parked:
        replica.woken_at = None  # parked again: a new wake is needed before it serves
    replica.parked = parked


@dataclass
class ReplicaSet:
    """Replicas by URL, with a hook so policies can rebuild (e.g. the hash ring) on change."""

    replicas: dict[str, Replica] = field(default_factory=dict)
    on_change: list[Callable[[], None]] = field(default_factory=list)
    # Called whenever readiness may have changed (the hold queue releases on it).
    on_ready: list[Callable[[], None]] = field(default_factory=list)

    @classmethod
    def static(cls, urls: Iterable[str]) -> ReplicaSet:
        replica_set = cls()
        replica_set.replace(urls)
        return replica_set

    def ordered(self) -> list[Replica]:
        """All replicas in a stable order (by URL), so round-robin and lanes do not reshuffle."""
        return [self.replicas[url] for url in sorted(self.replicas)]

    def ready(self) -> list[Replica]:
        return [r for r in self.ordered() if r.is_ready]

    def get(self, url: str) -> Replica | None:
        return self.replicas.get(url)

    def replace(
        self, urls: Iterable[str], ready: dict[str, bool] | None = None, draining: Iterable[str] = (),
        parked: Iterable[str] = (),
    ) -> None:
        """Make the set exactly `urls`; keep the state of replicas that stay."""
        wanted = list(dict.fromkeys(urls))
        changed = set(wanted) != set(self.replicas)
        # A dropped replica leaves the set at once; requests already on it hold their
        # own reference and finish (or fail) there, but nothing new is routed to it.
        for url in list(self.replicas):
            if url not in wanted:
                del self.replicas[url]
        marked, asleep = set(draining), set(parked)
        for url in wanted:
            replica = self.replicas.setdefault(url, Replica(url=url))
            if ready is not None:
                replica.discovered_ready = ready.get(url, False)
            replica.draining = url in marked
            _set_parked(replica, url in asleep)
        if changed:
            self._notify()
        self.ready_changed()

    def upsert(self, url: str, discovered_ready: bool, draining: bool = False, parked: bool = False) -> None:
        is_new = url not in self.replicas
        replica = self.replicas.setdefault(url, Replica(url=url))
        replica.discovered_ready = discovered_ready
        replica.draining = draining
        _set_parked(replica, parked)
        if is_new:
            self._notify()
        self.ready_changed()

    def ready_changed(self) -> None:
        for callback in self.on_ready:
            callback()

    async def wait_ready(self, exclude: set[str], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a ready replica not in ``exclude``; True once there is one.

        Readiness is re-read whenever it may have changed (every scrape, every discovery event).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not any(r.url not in exclude for r in self.ready()):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            changed = asyncio.Event()
            self.on_ready.append(changed.set)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
            finally:
                self.on_ready.remove(changed.set)
        return True

    def remove(self, url: str) -> None:
        if self.replicas.pop(url, None) is not None:
            self._notify()

    def mark_unreachable(self, url: str) -> None:
        replica = self.replicas.get(url)
        if replica is not None:
            replica.reachable = False

    def away(self) -> bool:
        """Some replica is away (served before, restarting now): a request may wait for it."""
        return any(r.is_away for r in self.replicas.values())

    def record_probe(
        self, replica: Replica, answered: bool, *, refused: bool = False, now: float | None = None
    ) -> None:
        """Count probes that got no answer (``refused``: refused or reset rather than timed out); when
        that makes the replica lost (see ``LOST_AFTER_PROBES``), tell its open streams, once."""
        now = time.monotonic() if now is None else now
        if answered:
            replica.probe_failures, replica.lost = 0, False
            replica.heard(now)
            return
        replica.probe_failures += 1
        replica.last_refused = refused
        silent = now - replica.last_heard >= LOST_SILENCE_S
        lost = (refused and replica.probe_failures >= LOST_AFTER_PROBES) or (
            silent and replica.probe_failures >= LOST_AFTER_SILENT_PROBES
        )
        if lost and not replica.lost:
            replica.lost = True
            for listener in list(replica.lost_listeners):
                listener()

    def record_scrape(self, url: str, *, waiting: float | None, running: float | None, engine: str | None) -> None:
        replica = self.replicas.get(url)
        if replica is None:
            return
        replica.waiting, replica.running, replica.engine = waiting, running, engine
        replica.last_scrape = time.monotonic()

    def set_weights(self, weights: dict[str, float], rates: dict[str, float] | None = None) -> None:
        """Each listed replica's capacity weight (others 1.0) and requests/s at it (others None).

        A weight change rebuilds what hashes by weight.
        """
        changed = False
        for url, replica in self.replicas.items():
            weight = weights.get(url, 1.0)
            if weight > 0 and replica.weight != weight:
                replica.weight, changed = weight, True
            rate = (rates or {}).get(url)
            replica.rate = rate if rate is not None and rate > 0 else None
        if changed:
            self._notify()

    def record_load(self, url: str, load: TokenLoad | None) -> None:
        """The replica's backlog and rates as just scraped (``slo_routing.py`` predicts TTFT from them)."""
        replica = self.replicas.get(url)
        if replica is not None:
            replica.token_load, replica.inflight_at_scrape = load, replica.inflight

    def record_adapters(self, url: str, *, adapters: frozenset[str] | None, active: frozenset[str]) -> None:
        replica = self.replicas.get(url)
        if replica is not None:
            replica.adapters, replica.active_adapters = adapters, active

    def _notify(self) -> None:
        for callback in self.on_change:
            callback()
