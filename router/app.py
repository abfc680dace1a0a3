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
from plimsoll.router.config import RouterConfig
from plimsoll.router.metrics import RouterMetrics
from plimsoll.router.policy import Router
from plimsoll.router.proxy import Proxy
from plimsoll.router.scrape import Scraper

PROXIED = ("/v1/completions", "/v1/chat/completions", "/v1/models")


class RouterState:
    """Everything one running router holds; exposed on ``app.state.router`` for tests and debugging."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.replica_set = ReplicaSet.static(config.backends)
        self.router = Router(config, self.replica_set)
        self.metrics = RouterMetrics()
        self.client: httpx.AsyncClient | None = None
        self.scraper: Scraper | None = None
        self.proxy: Proxy | None = None


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
                                    timeout_s=config.scrape_timeout_s, engine=config.metrics_engine)
            state.proxy = Proxy(config, state.replica_set, state.router, state.metrics, client)
            # One probe before serving, so /ready is truthful from the first request.
            await state.scraper.scrape_all()
            tasks = [asyncio.create_task(state.scraper.run(), name="router-scrape")]
            if config.llmservice is not None:
                from plimsoll.router.discovery import PodDiscovery

                tasks.append(asyncio.create_task(PodDiscovery(config, state.replica_set).run(),
                                                 name="router-discovery"))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def proxied(request: Request) -> Response:
        assert state.proxy is not None, "the lifespan starts the proxy before serving"
        response: Response = await state.proxy.forward(request)
        return response

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(_: Request) -> Response:
        ready_urls = [r.url for r in state.replica_set.ready()]
        body = {"ready": bool(ready_urls), "ready_replicas": ready_urls,
                "replicas": sorted(state.replica_set.replicas)}
        return JSONResponse(body, status_code=200 if ready_urls else 503)

    async def metrics(_: Request) -> Response:
        state.metrics.observe_replicas(state.replica_set)
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/v1/completions", proxied, methods=["POST"]),
        Route("/v1/chat/completions", proxied, methods=["POST"]),
        Route("/v1/models", proxied, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.router = state
    return app
