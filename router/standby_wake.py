"""Waking a parked replica from the router, the moment every awake one is past its target.

What it is: :class:`StandbyWaker`. With ``autoscaling.standby`` the operator parks
replicas asleep beside the active ones and wakes them when its next scrape shows the
load; until then the awake replicas queue what a step in load brings. The router sees
the step with the request that causes it, so it acts on it there: when a generation
request would put every ready replica past its target in flight (the
autoscaler's target per replica, ``status.autoscaler.inputs.targetInFlightPerReplica``,
or ``--standby-wake-inflight``; a hardware variant's replica: its variant's own, ``weight``), it wakes one parked replica (``POST /wake_up`` with the
wake key, which the replicas take on that path alone) and the request waits up to ``wait_s`` for it instead of queueing behind the
busy ones. One wake takes up to the woken replica's target of such requests (rounded up); the next one
past that wakes another parked replica, until none is left. A woken replica serves at
once, before its pod turns Ready again; ``GET /hold`` tells the operator which pods the
router woke (``wokenStandby``), and the operator takes them in as a scale-up or parks
them again.

What it is not: the count. The operator decides how many replicas stay active; the
router only brings one forward by the second its scrape would take. A wake that fails
or takes longer than ``wait_s`` costs the waiting requests that wait: they then go
where they would have gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

import httpx

from plimsoll.bounded_http import SMALL_LIMIT_BYTES, fetch_capped
from plimsoll.router.backends import Replica, ReplicaSet
from plimsoll.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

# A level-2 wake reloads the weights; longer than this and the replica is left to the operator.
WAKE_TIMEOUT_S = 120.0


@dataclass
class Wake:
    """One wake under way: the replica, the requests waiting for it, and when it is over."""

    url: str
    started: float
    done: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0
    room: int = 1  # the requests one wake takes: the woken replica's target, rounded up


class StandbyWaker:
    """Wakes parked replicas of ``replica_set`` when every ready one is past ``threshold`` in flight."""

    def __init__(
        self,
        replica_set: ReplicaSet,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        *,
        threshold: float | None,
        wait_s: float,
        wake_key: str | None,
    ) -> None:
        self._replica_set = replica_set
        self._client = client
        self._metrics = metrics
        self.threshold = threshold
        self._fixed = threshold is not None  # --standby-wake-inflight wins over the LLMService's status
        self.wait_s = wait_s
        self._auth = {"Authorization": f"Bearer {wake_key}"} if wake_key else {}
        self.wakes: dict[str, Wake] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def take_target(self, target: float | None) -> None:
        """The autoscaler's target in flight per replica, from the LLMService's status (unless fixed)."""
        if not self._fixed and target is not None and target > 0:
            self.threshold = float(target)

    def pressed(self) -> bool:
        """Every ready replica would be past its target with one more request (and some replica is ready).

        This router's own in-flight count, not the scraped queue: a scrape a second old still shows the
        requests a closed loop has just finished, and would wake a replica the load does not need. With
        several routers each sees only its share, and wakes later; the operator's scrape still counts all.
        """
        ready = self._replica_set.ready()
        targets = [self._target(r) for r in ready]
        return bool(ready) and all(
            t is not None and r.inflight + 1 > t for r, t in zip(ready, targets, strict=True)
        )

    def _target(self, replica: Replica) -> float | None:
        """In flight at its target: its variant's own (``weight``, with a measured rate) or the service's."""
        return replica.weight if replica.rate is not None else self.threshold

    def reserve(self) -> Wake | None:
        """The wake this request should wait for, starting one if needed; None: route it as usual."""
        if not self.pressed():
            return None
        for wake in self.wakes.values():
            if not wake.done.is_set() and wake.waiting < wake.room:
                wake.waiting += 1
                return wake
        parked = [
            r for r in self._replica_set.ordered() if r.parked and not r.is_ready and r.url not in self.wakes
        ]
        target = self._target(parked[0]) if parked else None
        if target is None:
            return None
        wake = Wake(parked[0].url, time.monotonic(), waiting=1, room=max(1, math.ceil(target)))
        self.wakes[wake.url] = wake
        task = asyncio.create_task(self._wake(wake, parked[0]), name=f"wake {wake.url}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return wake

    async def wait(self, wake: Wake) -> None:
        """Wait up to ``wait_s`` for ``wake``; the request is then routed as any other."""
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.done.wait(), self.wait_s)
        finally:
            wake.waiting -= 1

    async def _wake(self, wake: Wake, replica: Replica) -> None:
        why, ok = "", False
        try:
            response = await fetch_capped(self._client, "POST", f"{wake.url}/wake_up", SMALL_LIMIT_BYTES,
                                          headers=self._auth, timeout=httpx.Timeout(WAKE_TIMEOUT_S))  # fmt: skip
            ok = response.status_code == 200
            why = f"answered {response.status_code}: {response.text[:200]}"
        except (httpx.HTTPError, httpx.StreamError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        finally:
            took = time.monotonic() - wake.started
            if ok and self._replica_set.get(wake.url) is replica and replica.parked:
                replica.woken_at, replica.reachable = time.monotonic(), True
                log.info("woke parked replica %s (%s) in %.3f s: every ready replica was at its target in flight",
                         wake.url, replica.pod or "static", took)  # fmt: skip
                self._metrics.standby_wakes.labels("woken").inc()
                self._metrics.standby_wake_seconds.observe(took)
            else:
                log.warning("could not wake parked replica %s (%s); requests go to the awake ones", wake.url,
                            why or "gone from the replica set")  # fmt: skip
                self._metrics.standby_wakes.labels("failed").inc()
            del self.wakes[wake.url]
            wake.done.set()
            self._replica_set.ready_changed()

    def woken(self) -> dict[str, float]:
        """``GET /hold``'s ``wokenStandby``: pod -> seconds since this router woke it, while it still
        carries the standby label and serves."""
        now = time.monotonic()
        return {
            r.pod: round(now - r.woken_at, 3)
            for r in self._replica_set.replicas.values()
            if r.parked and r.woken_at is not None and r.is_ready and r.pod
        }


__all__ = ["StandbyWaker", "Wake"]
