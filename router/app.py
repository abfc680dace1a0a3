"""The router's ASGI app: OpenAI endpoints proxied, plus /health, /ready and /metrics.

What it is: the wiring of config, replica set, policy, scraper, discovery and
proxy into one Starlette app whose lifespan starts and stops the background
loops and the upstream HTTP client. What it is not: the server process; the
CLI (or a test) runs it with uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from plimsoll.router.backends import ReplicaSet
from plimsoll.router.config import Policy, RouterConfig
from plimsoll.router.hold import ColdStarts, HoldQueue
from plimsoll.router.kv_events import KVEventSubscriber, events_endpoint
from plimsoll.router.kv_index import KVBlockIndex
from plimsoll.router.metrics import RouterMetrics
from plimsoll.router.policy import Router
from plimsoll.router.prefill_decode import PrefillDecode
from plimsoll.router.prompt_tokens import PromptTokens, load_tokenizer
from plimsoll.router.proxy import Proxy
from plimsoll.router.scrape import Scraper
from plimsoll.router.standby_wake import StandbyWaker
from plimsoll.tracing import TraceMiddleware

PROXIED = ("/v1/completions", "/v1/chat/completions", "/v1/models")


class RouterState:
    """Everything one running router holds; exposed on ``app.state.router`` for tests and debugging."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        # On a split fleet `replica_set` is the decode pool (where tokens are generated) and
        # `prefill_set` the prefill pool; otherwise the one pool, and no prefill set.
        self.replica_set = ReplicaSet.static(config.decode_backends if config.is_split else config.backends)
        self.prefill_set: ReplicaSet | None = ReplicaSet.static(config.prefill_backends) if config.is_split else None
        self.metrics = RouterMetrics()
        self.kv_events: KVEventSubscriber | None = None
        self.prompt_tokens: PromptTokens | None = None
        kv = None
        if config.generation_policy is Policy.PRECISE_PREFIX:
            index = KVBlockIndex(max_replicas=config.kv_index_max_replicas)
            self.kv_events = KVEventSubscriber(index, stale_after_s=config.kv_events_stale_after_s,
                                               topic=config.kv_events_topic, metrics=self.metrics)  # fmt: skip
            kv = (index, self.kv_events)
        self.router = Router(config.model_copy(update={"policy": config.generation_policy}), self.replica_set, kv)
        self.prefill_router: Router | None = None
        if self.prefill_set is not None:
            # Prefill goes to the least-loaded replica: its blocks leave with the pull, so affinity buys nothing.
            prefill_config = config.model_copy(update={"policy": Policy.LEAST_INFLIGHT, "lanes": None})
            self.prefill_router = Router(prefill_config, self.prefill_set)
        self.client: httpx.AsyncClient | None = None
        self.scraper: Scraper | None = None
        self.proxy: Proxy | None = None
        self.prefill_decode: PrefillDecode | None = None
        self.hold: HoldQueue | None = None
        self.waker: StandbyWaker | None = None
        # SIGTERM (lifecycle.py): /ready answers 503 so no new traffic is sent here; requests still served.
        self.draining = False
        if config.hold_queue > 0:
            self.hold = HoldQueue(
                config.hold_queue,
                lambda: len(self.replica_set.ready()),
                ColdStarts(fallback_s=config.cold_start_fallback_s),
                release_concurrency=config.release_concurrency,
                timeout_override_s=config.hold_timeout_s,
                # With an LLMService the operator measures cold starts (status.coldStart); alone, the router does.
                record_cold_starts=config.llmservice is None,
            )
            self.replica_set.on_ready.append(self.hold.pump)

    def sync_kv_feeds(self) -> None:
        """Subscribe to the KV events of every replica in the set, and only those."""
        if self.kv_events is None:
            return
        config = self.config
        current = set(self.replica_set.replicas)
        for url in list(self.kv_events.feeds):
            if url not in current:
                self.kv_events.unwatch(url)
        for url in current:
            self.kv_events.watch(url, config.kv_events_endpoints.get(url) or events_endpoint(url, config.kv_events_port))

    def take_status(self, status: dict[str, object]) -> None:
        """The LLMService's status, polled by discovery: the operator's measured cold starts."""
        cold = status.get("coldStart")
        samples = cold.get("samplesSeconds") if isinstance(cold, dict) else None
        if self.hold is not None and isinstance(samples, list) and samples:
            self.hold.cold_starts.replace(float(s) for s in samples)
        capacity = status.get("capacity")
        profiled = capacity.get("concurrencyPerReplica") if isinstance(capacity, dict) else None
        if self.hold is not None and self.config.release_concurrency is None and isinstance(profiled, int | float):
            # Profile mode: the verified concurrency is only in status (the CLI flag wins when given).
            self.hold.release_concurrency = max(1, int(profiled))
        autoscaler = status.get("autoscaler")
        inputs = autoscaler.get("inputs") if isinstance(autoscaler, dict) else None
        target = inputs.get("targetInFlightPerReplica") if isinstance(inputs, dict) else None
        if self.waker is not None and isinstance(target, int | float) and not isinstance(target, bool):
            self.waker.take_target(float(target))


def build_app(config: RouterConfig) -> Starlette:
    state = RouterState(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        timeout = httpx.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s,
                                write=config.connect_timeout_s, pool=config.connect_timeout_s)
        # No connection cap: the router's own saturation limit is the cap, and a pool
        # limit would queue requests here where no metric shows it.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            state.client = client
            state.scraper = Scraper(state.replica_set, client, state.metrics, interval_s=config.scrape_interval_s,
                                    timeout_s=config.scrape_timeout_s, engine=config.metrics_engine,
                                    api_key=config.api_key)
            state.proxy = Proxy(config, state.replica_set, state.router, state.metrics, client, hold=state.hold)
            if config.standby_wake and not config.is_split:
                state.waker = state.proxy.waker = StandbyWaker(
                    state.replica_set, client, state.metrics, threshold=config.standby_wake_inflight,
                    wait_s=config.standby_wake_wait_s, wake_key=config.wake_api_key,
                )  # fmt: skip
            scrapers = [state.scraper]
            if state.prefill_set is not None:
                assert state.prefill_router is not None
                scrapers.append(Scraper(state.prefill_set, client, state.metrics, interval_s=config.scrape_interval_s,
                                        timeout_s=config.scrape_timeout_s, engine=config.metrics_engine))  # fmt: skip
                prefill_proxy = Proxy(config, state.prefill_set, state.prefill_router, state.metrics, client)
                state.prefill_decode = PrefillDecode(state.prefill_set, state.prefill_router, state.proxy,
                                                     prefill_proxy, state.metrics, client, config.prefill_timeout_s)  # fmt: skip
            if state.kv_events is not None:
                assert config.kv_tokenizer is not None
                tokenizer = await asyncio.to_thread(load_tokenizer, config.kv_tokenizer)
                state.prompt_tokens = PromptTokens(tokenizer)
                state.proxy.prompt_tokens = state.prompt_tokens
                state.proxy.kv_events = state.kv_events
                state.replica_set.on_change.append(state.sync_kv_feeds)
                state.sync_kv_feeds()
            # One probe before serving, so /ready is truthful from the first request.
            await asyncio.gather(*(s.scrape_all() for s in scrapers))
            tasks = [asyncio.create_task(s.run(), name="router-scrape") for s in scrapers]
            if config.llmservice is not None:
                from plimsoll.router.discovery import PodDiscovery

                if state.prefill_set is None:
                    discovery = PodDiscovery(config, state.replica_set, on_status=state.take_status)
                    tasks.append(asyncio.create_task(discovery.run(), name="router-discovery"))
                else:  # each pool from its pods' plimsoll.dev/role label
                    for role, pool, on_status in (("decode", state.replica_set, state.take_status),
                                                  ("prefill", state.prefill_set, None)):  # fmt: skip
                        discovery = PodDiscovery(config, pool, on_status=on_status, role=role)
                        tasks.append(asyncio.create_task(discovery.run(), name=f"router-discovery-{role}"))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if state.kv_events is not None:
                    state.kv_events.close()

    async def proxied(request: Request) -> Response:
        assert state.proxy is not None, "the lifespan starts the proxy before serving"
        if state.prefill_decode is not None:
            split: Response = await state.prefill_decode.forward(request)
            return split
        response: Response = await state.proxy.forward(request)
        return response

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(_: Request) -> Response:
        # Counts, not addresses: /ready is open to anyone who reaches the router, and the pods'
        # addresses are not theirs to learn (the NetworkPolicy keeps them out of the pods anyway).
        num_ready = len(state.replica_set.ready())
        body = {"ready": bool(num_ready), "ready_replicas": num_ready,
                "replicas": len(state.replica_set.replicas), "holding": state.hold is not None}
        if state.prefill_set is not None:  # a split fleet serves while either pool can (fallbacks)
            num_prefill = len(state.prefill_set.ready())
            num_ready += num_prefill
            body.update(ready=bool(num_ready), ready_prefill_replicas=num_prefill,
                        prefill_replicas=len(state.prefill_set.replicas))
        if state.draining:
            return JSONResponse({**body, "ready": False, "draining": True}, status_code=503)
        # A router that holds requests serves even at zero replicas: that is when it is needed most.
        return JSONResponse(body, status_code=200 if num_ready or state.hold is not None else 503)

    async def hold(_: Request) -> Response:
        """What the operator polls each tick to scale from zero: held requests and the cold-start basis."""
        # shedSloTotal: requests refused because every replica would miss their TTFT bound; refusedTotal:
        # every request the router answered itself, by reason (the operator counts the ones that say the
        # service lacked room as demand and as SLO misses).
        proxy = state.proxy
        # wokenStandby: parked pods this router woke itself (standby_wake.py), for the operator to take in.
        shed = {
            "shedSloTotal": proxy.shed_slo_total if proxy is not None else 0,
            "refusedTotal": dict(proxy.refused_total) if proxy is not None else {},
            "wokenStandby": state.waker.woken() if state.waker is not None else {},
        }
        if state.hold is None:
            return JSONResponse({"held": 0, "capacity": 0, "enabled": False, **shed})
        return JSONResponse({"enabled": True, **state.hold.demand(), **shed})

    async def metrics(_: Request) -> Response:
        pools = state.replica_set
        if state.prefill_set is not None:
            pools = ReplicaSet(replicas={**state.prefill_set.replicas, **state.replica_set.replicas})
        state.metrics.observe_replicas(pools)
        if state.kv_events is not None:
            state.metrics.observe_kv(state.kv_events)
        if state.hold is not None:
            state.metrics.held.set(state.hold.held)
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/v1/completions", proxied, methods=["POST"]),
        Route("/v1/chat/completions", proxied, methods=["POST"]),
        Route("/v1/models", proxied, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/hold", hold, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(TraceMiddleware)
    app.state.router = state
    return app


@contextlib.asynccontextmanager
async def running_router(config: RouterConfig, host: str = "127.0.0.1") -> AsyncIterator[tuple[str, RouterState]]:
    """A router serving on ``host`` and a free port inside the caller's event loop: (its URL, its state).

    What `plimsoll bench disagg` routes each layout through, and the router tests' harness.
    """
    import uvicorn

    app = build_app(config)
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=0, log_level="warning", ws="none", lifespan="on", access_log=False)
    )
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(60):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("the router exited before it started")
                await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{host}:{port}", app.state.router
    finally:
        server.should_exit = True
        await task
