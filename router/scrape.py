"""Periodic readiness probes and /metrics scrapes of every replica.

What it is: a loop that, every ``scrape_interval_s``, asks each replica whether
it is ready (``/ready``, or ``/health`` for engines without it, such as vLLM)
and reads its waiting and running queues from ``/metrics`` in either the
plimsoll or the vLLM spelling (:mod:`plimsoll.metric_names`). A replica that
exports ``lora_requests_info`` (LoRA on) is also asked ``/v1/models`` for the
adapters it serves; the gauge's labels say which are active. What it is not:
a metrics store; only the latest values are kept, on the replica itself. Every
answer is read with a byte cap (``plimsoll.bounded_http``).
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from plimsoll.bounded_http import METRICS_LIMIT_BYTES, MODELS_LIMIT_BYTES, SMALL_LIMIT_BYTES, fetch_capped
from plimsoll.metric_names import (
    BACKLOG_SECONDS,
    DECODE_STEP_SECONDS,
    ENGINE_FAMILIES,
    LORA_REQUESTS_INFO_NAMES,
    PREFILL_TOKENS_PER_SECOND,
    EngineMetricNames,
    detect_family,
)
from plimsoll.prometheus import Scrape, parse
from plimsoll.router.backends import Replica, ReplicaSet, TokenLoad
from plimsoll.router.metrics import RouterMetrics

log = logging.getLogger(__name__)


def active_adapters(scrape: Scrape) -> frozenset[str] | None:
    """Adapters named running or waiting by the newest ``lora_requests_info`` sample; None without the gauge.

    The gauge's value is the time its labels were set, so when an engine leaves older
    label sets behind, the largest value is the current one.
    """
    rows = [row for name in LORA_REQUESTS_INFO_NAMES for row in scrape.samples.get(name, [])]
    if not rows:
        return None
    labels, _ = max(rows, key=lambda row: row[1])
    names = f"{labels.get('running_lora_adapters', '')},{labels.get('waiting_lora_adapters', '')}"
    return frozenset(n for n in names.split(",") if n)


def served_adapters(models: object) -> frozenset[str]:
    """Adapter names in a ``/v1/models`` answer: the cards with a ``parent`` (the base model)."""
    data = models.get("data") if isinstance(models, dict) else None
    return frozenset(
        str(card["id"]) for card in data or [] if isinstance(card, dict) and card.get("parent") and "id" in card
    )


def token_load(scrape: Scrape) -> TokenLoad | None:
    """A plimsoll replica's backlog (seconds) and measured rates, for predicted-TTFT routing (None: any
    of them absent, as from vLLM or before the replica measured its rates)."""
    names = (BACKLOG_SECONDS, PREFILL_TOKENS_PER_SECOND, DECODE_STEP_SECONDS)
    values = [scrape.values(name) for name in names]
    if not all(values):
        return None
    backlog, prefill, decode = (max(v) for v in values)
    return TokenLoad(backlog, prefill, decode)


def parse_queue(text: str | Scrape, engine: str | None = None) -> tuple[float | None, float | None, str | None]:
    """Return (waiting, running, engine family name) summed over label sets from an exposition text."""
    scrape = parse(text) if isinstance(text, str) else text
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
        api_key: str | None = None,
    ) -> None:
        self._replica_set = replica_set
        # /v1/models is behind the replicas' key when they have one.
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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
            # Refused or reset: nothing listens there. A timeout may be a replica too busy to answer.
            refused = not isinstance(exc, httpx.TimeoutException)
            self._replica_set.record_probe(replica, answered=False, refused=refused)
            return
        # An answer, even a 503 (draining, warming up): the process is there and its streams go on.
        self._replica_set.record_probe(replica, answered=True)
        replica.seen_ready = replica.seen_ready or replica.reachable
        try:
            response = await fetch_capped(self._client, "GET", f"{replica.url}/metrics", METRICS_LIMIT_BYTES,
                                          timeout=self._timeout)  # fmt: skip
            response.raise_for_status()
            scrape = parse(response.text)
            waiting, running, engine = parse_queue(scrape, self._engine)
        except (httpx.HTTPError, ValueError) as exc:
            # Routing still works on the router's own in-flight count without a scrape.
            log.debug("scrape of %s failed: %s", replica.url, exc)
            return
        self._replica_set.record_scrape(replica.url, waiting=waiting, running=running, engine=engine)
        self._replica_set.record_load(replica.url, token_load(scrape))
        active = active_adapters(scrape)
        adapters: frozenset[str] | None = None
        if active is not None:
            try:
                models = await fetch_capped(self._client, "GET", f"{replica.url}/v1/models", MODELS_LIMIT_BYTES,
                                            headers=self._auth, timeout=self._timeout)  # fmt: skip
                models.raise_for_status()
                adapters = served_adapters(models.json()) | active
            except (httpx.HTTPError, ValueError) as exc:
                log.debug("adapter list of %s failed: %s", replica.url, exc)
                adapters = active  # at least those it is running
        self._replica_set.record_adapters(replica.url, adapters=adapters, active=active or frozenset())

    async def _probe(self, url: str) -> bool:
        if url not in self._health_only:
            response: httpx.Response = await fetch_capped(
                self._client, "GET", f"{url}/ready", SMALL_LIMIT_BYTES, timeout=self._timeout
            )
            if response.status_code != 404:
                return response.status_code == 200
            self._health_only.add(url)
        health: httpx.Response = await fetch_capped(
            self._client, "GET", f"{url}/health", SMALL_LIMIT_BYTES, timeout=self._timeout
        )
        return health.status_code == 200
