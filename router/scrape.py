"""Periodic readiness probes and /metrics scrapes of every replica.

What it is: a loop that, every ``scrape_interval_s``, asks each replica whether
it is ready (``/ready``, or ``/health`` for engines without it, such as vLLM)
and reads its waiting and running queues from ``/metrics`` in either the
plimsoll or the vLLM spelling (:mod:`plimsoll.metric_names`). What it is not:
a metrics store; only the latest values are kept, on the replica itself.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from plimsoll.metric_names import ENGINE_FAMILIES, EngineMetricNames, detect_family
from plimsoll.prometheus import parse
from plimsoll.router.backends import Replica, ReplicaSet
from plimsoll.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


def parse_queue(text: str, engine: str | None = None) -> tuple[float | None, float | None, str | None]:
    """Return (waiting, running, engine family name) summed over label sets from an exposition text."""
    scrape = parse(text)
    names: EngineMetricNames | None = (
        ENGINE_FAMILIES[engine] if engine is not None else detect_family(scrape.names())
    )
    if names is None:
        return None, None, None
    family_name = next(k for k, v in ENGINE_FAMILIES.items() if v is names)
    return scrape.sum(names.waiting), scrape.sum(names.running), family_name


class Scraper:
    """Keeps every replica's readiness and queue lengths fresh."""

    def __init__(
        self,
        replica_set: ReplicaSet,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        *,
        interval_s: float,
        timeout_s: float,
        engine: str | None = None,
    ) -> None:
        self._replica_set = replica_set
        self._client = client
        self._metrics = metrics
        self._interval_s = interval_s
        self._timeout = httpx.Timeout(timeout_s)
        self._engine = engine
        # Replicas that answered 404 on /ready: probe /health instead.
        self._health_only: set[str] = set()

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self._interval_s)

    async def scrape_all(self) -> None:
        replicas = list(self._replica_set.replicas.values())
        await asyncio.gather(*(self.scrape(r) for r in replicas))
        self._metrics.observe_replicas(self._replica_set)
        self._replica_set.ready_changed()

    async def scrape(self, replica: Replica) -> None:
        try:
            replica.reachable = await self._probe(replica.url)
        except httpx.HTTPError as exc:
            if replica.reachable:
                log.warning("replica %s unreachable: %s", replica.url, exc)
            replica.reachable = False
            return
        try:
            response = await self._client.get(f"{replica.url}/metrics", timeout=self._timeout)
            response.raise_for_status()
            waiting, running, engine = parse_queue(response.text, self._engine)
        except (httpx.HTTPError, ValueError) as exc:
            # Routing still works on the router's own in-flight count without a scrape.
            log.debug("scrape of %s failed: %s", replica.url, exc)
            return
        self._replica_set.record_scrape(replica.url, waiting=waiting, running=running, engine=engine)

    async def _probe(self, url: str) -> bool:
        if url not in self._health_only:
            response = await self._client.get(f"{url}/ready", timeout=self._timeout)
            if response.status_code != 404:
                return response.status_code == 200
            self._health_only.add(url)
        response = await self._client.get(f"{url}/health", timeout=self._timeout)
        return response.status_code == 200
