"""The HTTP face of one replica: an OpenAI-compatible API, health, readiness and metrics.

What it is: :func:`build_app` wires an engine (``AsyncEngine`` or anything with
its interface), :class:`ServerSettings` and :class:`ServerMetrics` into a FastAPI
app with ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health`` (alive), ``/ready`` (weights, KV cache and warm-up done, not
draining) and ``/metrics``. The engine is started in the background by the
app's lifespan, so ``/health`` answers while weights load.

What it is not: the process around it (``cli.py`` builds the engine and runs
uvicorn through ``lifecycle.DrainingServer``) or the engine itself.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plimsoll import __version__
from plimsoll.auth import bearer_matches
from plimsoll.runtime.engine.client import EngineClient
from plimsoll.runtime.engine.startup import STARTUP
from plimsoll.runtime.serving.auth import AuthMiddleware
from plimsoll.runtime.serving.chat import create_chat_completion
from plimsoll.runtime.serving.completions import create_completion
from plimsoll.runtime.serving.errors import APIError, install_error_handlers
from plimsoll.runtime.serving.lora_admin import LoRAAdmin
from plimsoll.runtime.serving.metrics import ServerMetrics
from plimsoll.runtime.serving.openapi import install_openapi
from plimsoll.runtime.serving.profiling import add_profile_route
from plimsoll.runtime.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    SLOObjectives,
    UnloadLoRAAdapterRequest,
)
from plimsoll.runtime.serving.requests import ServingContext
from plimsoll.runtime.serving.settings import ServerSettings
from plimsoll.runtime.serving.sleep_routes import add_sleep_routes, asleep_error
from plimsoll.runtime.serving.template_pool import TemplatePool
from plimsoll.tracing import TraceMiddleware

log = logging.getLogger("plimsoll.runtime.serving.server")

__all__ = ["ServerSettings", "build_app"]


class BodyLimitMiddleware:
    """Refuse a request body over ``max_bytes`` with 413, reading no more of it than that.

    A declared ``Content-Length`` over the limit is refused before any byte is read;
    a chunked body is counted as it arrives. Without this a 10 MB prompt is read,
    parsed and held in memory before anything can say no.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> APIError:
        return APIError(
            413,
            f"The request body is {size} bytes; this server accepts at most {self.max_bytes} "
            "(--max-request-bytes); send a smaller request.",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(declared.decode()).response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(f"more than {self.max_bytes}").response()(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices, as the server sends them

        await self.app(scope, replay, send)


def build_app(
    engine: EngineClient,
    settings: ServerSettings,
    metrics: ServerMetrics | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``; pass the same ``metrics`` the engine observes.

    ``on_fatal`` is called, on the event loop, if the engine fails to start or its
    loop dies later (the CLI then drains and exits non-zero, so the kubelet
    restarts the pod); ``/health`` then answers 503 "engine failed". ``on_ready`` is called,
    on the event loop, once the engine has started.
    """
    metrics = metrics if metrics is not None else ServerMetrics(settings.served_model_name)
    ctx = ServingContext(engine=engine, settings=settings, metrics=metrics)
    if settings.allow_client_chat_template:
        ctx.templates = TemplatePool(settings.chat_template_workers)
    state: dict[str, Any] = {"fatal": None}

    def engine_died(exc: BaseException) -> None:  # on the event loop
        if state["fatal"] is None:
            state["fatal"] = exc
            log.error("the engine loop died (%r): draining and exiting non-zero", exc)
            if on_fatal is not None:
                on_fatal(exc)

    async def start_engine() -> None:
        loop = asyncio.get_running_loop()
        if hasattr(engine, "on_dead"):
            engine.on_dead = lambda exc: loop.call_soon_threadsafe(engine_died, exc)
        try:
            if not engine.is_ready:
                await engine.start()
            s = engine.stats()
            metrics.set_cache_config(
                block_size=s.block_size,
                num_blocks=s.num_blocks,
                enable_prefix_caching=s.enable_prefix_caching,
                cache_dtype=str(getattr(getattr(engine, "config", None), "dtype", "auto")),
                gpu_memory_utilization=getattr(s, "gpu_memory_utilization", None),
                kv_cache_memory_bytes=getattr(s, "kv_cache_memory_bytes", 0),
            )
            metrics.refresh(s)
            metrics.attach_kv_tiers(getattr(getattr(engine, "engine", None), "kv_connector", None))
            metrics.start_counting()
            STARTUP.mark("ready")
            if on_ready is not None:
                on_ready()
            log.info(
                "engine ready: model %s, %d KV blocks of %d tokens",
                settings.served_model_name,
                s.num_blocks,
                s.block_size,
            )
        except Exception as exc:
            state["fatal"] = exc
            log.exception("the engine failed to start")
            if on_fatal is not None:
                on_fatal(exc)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(start_engine())
        if ctx.templates is not None:
            ctx.templates.start()
        try:
            yield
        finally:
            if not starting.done():
                starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            if ctx.templates is not None:
                await ctx.templates.close()
            await engine.shutdown()

    app = FastAPI(title="plimsoll runtime", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    # Middleware added later runs earlier. Order on the way in: trace span, authentication,
    # body limit, app: a request without the right key is refused before its body is read,
    # and an oversized body before anything parses it.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(AuthMiddleware, api_key=settings.api_key, admin_api_key=settings.admin_api_key,
                       wake_api_key=settings.wake_api_key)  # fmt: skip
    if importlib.util.find_spec("fastapi.telemetry") is None:
        # FastAPI >= 0.16x opens its own server span (continuing traceparent) when
        # OpenTelemetry is installed; older ones get ours, outermost, covering auth and the response.
        app.add_middleware(TraceMiddleware)

    def check_serving(model: str | None) -> None:
        if state["fatal"] is not None or engine.is_dead:
            raise APIError(503, "The engine failed and this replica is shutting down; retry on another.")
        if not engine.is_ready:
            raise APIError(
                503,
                "The model is still loading; retry when /ready answers 200.",
                headers={"Retry-After": str(settings.retry_after_s)},
            )
        if ctx.sleeping:
            metrics.reject("asleep")
            raise asleep_error(ctx)
        if model is not None and model != settings.served_model_name:
            adapters = [lora.lora_name for lora in engine.list_loras()]
            if model not in adapters:
                valid = ", ".join([settings.served_model_name, *adapters])
                raise APIError(404, f"The model `{model}` does not exist. Valid model names: {valid}.", param="model")

    @app.get("/health")
    async def health() -> Response:
        if state["fatal"] is not None or engine.is_dead:
            return JSONResponse({"status": "engine failed"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if ctx.draining and not engine.is_dead:
            return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
        failed = state["fatal"] is not None or engine.is_dead
        startup = STARTUP.to_json()
        loading = not engine.is_ready or (ctx.templates is not None and not ctx.templates.is_started)
        if failed or loading:
            reason = "engine failed" if failed else "loading"
            return JSONResponse({"ready": False, "reason": reason, "startup": startup}, status_code=503)
        if ctx.marked_for_removal:
            return JSONResponse({"ready": False, "reason": "marked for removal"}, status_code=503)
        if ctx.sleeping:
            return JSONResponse({"ready": False, "reason": "asleep"}, status_code=503)
        return JSONResponse({"ready": True, "startup": startup})

    @app.post("/drain")
    async def mark_for_removal() -> Response:
        # The operator's two-phase scale-down: readiness drops, in-flight work finishes here.
        ctx.marked_for_removal = True
        return JSONResponse({"markedForRemoval": True, "inFlight": ctx.num_in_flight})

    @app.delete("/drain")
    async def unmark_for_removal() -> Response:
        ctx.marked_for_removal = False
        return JSONResponse({"markedForRemoval": False, "inFlight": ctx.num_in_flight})

    @app.put("/slo")
    async def set_slo(objectives: SLOObjectives) -> Response:
        # The operator's spec.slo, applied per request: plimsoll_slo_requests_total{result} counts against it.
        metrics.set_slo(objectives.seconds())
        return JSONResponse(objectives.model_dump(by_alias=True))

    @app.get("/slo")
    async def get_slo() -> Response:
        return JSONResponse(SLOObjectives.from_seconds(metrics.slo).model_dump(by_alias=True))

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if engine.is_ready:
            metrics.refresh(engine.stats())
            metrics.refresh_load(engine.queue_snapshot(), engine.service_rates(), engine.sleep_level)
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", response_model=ModelList)
    async def models(raw: Request) -> ModelList:
        # An adapter's `root` is its path (vLLM's field) only for the admin key's holder (the operator
        # compares it with spec.adapters); everyone else sees names: where weights live on the
        # replica is nobody's business who holds only the inference key.
        admin = bool(
            settings.admin_api_key and bearer_matches(raw.headers.get("authorization"), settings.admin_api_key)
        )
        card = ModelCard(
            id=settings.served_model_name,
            created=int(time.time()),
            root=settings.served_model_name,
            max_model_len=engine.max_model_len if engine.is_ready else None,
        )
        adapters = [
            ModelCard(id=lora.lora_name, created=card.created, root=lora.lora_path if admin else lora.lora_name,
                      parent=settings.served_model_name, max_model_len=card.max_model_len)
            for lora in engine.list_loras()
        ]
        return ModelList(data=[card, *adapters])

    lora_admin = LoRAAdmin(engine, settings)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        await lora_admin.load(body.lora_name, body.lora_path)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        await lora_admin.unload(body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_serving(body.model)
        response: Response = await create_completion(ctx, body, raw)
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_serving(body.model)
        response: Response = await create_chat_completion(ctx, body, raw)
        return response

    add_sleep_routes(app, ctx)
    profile_dir = Path(settings.profile_dir) if settings.profile_dir else None
    add_profile_route(app, engine, settings.enable_profiling, profile_dir)
    install_openapi(app)  # every response documented, not only the 200s
    return app
