"""vLLM's sleep-mode endpoints: ``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping``.

What it is: :func:`add_sleep_routes`. ``/sleep`` refuses while requests are in flight
(409: drain first, as the operator does before it parks a replica) and, without
``--enable-sleep-mode``, altogether (400). While asleep the replica answers ``/ready``
with 503 ``{"reason": "asleep"}`` (so nothing routes to it) and generation requests
with 503, ``Retry-After`` and ``x-plimsoll-overload: replica``. ``/wake_up`` brings it
back (the ``tags`` vLLM accepts for a partial wake are ignored: the whole engine
wakes). The two control endpoints are admin paths (``plimsoll.auth``).

What it is not: the freeing and reloading (``engine/sleep_mode.py``) or the decision
to sleep (the operator's planner).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from plimsoll.overload import OVERLOAD_HEADER, REPLICA
from plimsoll.runtime.engine.sleep_mode import SLEEP_LEVELS, SleepModeError
from plimsoll.runtime.serving.errors import APIError
from plimsoll.runtime.serving.requests import ServingContext


def asleep_error(ctx: ServingContext) -> APIError:
    """503 for a request that reaches a sleeping replica: another replica (or a wake-up) serves it."""
    return APIError(
        503,
        "This replica is asleep (sleep mode) and serves nothing until POST /wake_up; retry on another replica.",
        headers={"Retry-After": str(ctx.settings.retry_after_s), OVERLOAD_HEADER: REPLICA},
    )


def add_sleep_routes(app: FastAPI, ctx: ServingContext) -> None:
    engine = ctx.engine
    lock = asyncio.Lock()  # one transition at a time

    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        if not engine.config.enable_sleep_mode:
            raise APIError(400, "Sleep mode is off on this server; start it with --enable-sleep-mode.")
        if level not in SLEEP_LEVELS:
            raise APIError(400, f"level must be 1 or 2, got {level}.", param="level")
        if not engine.is_ready:
            raise APIError(503, "The model is still loading; retry when /ready answers 200.")
        async with lock:
            ctx.sleeping = True  # refuse new requests from now on, before the engine is told
            if ctx.num_in_flight:
                if not engine.sleep_level:
                    ctx.sleeping = False
                raise APIError(
                    409,
                    f"{ctx.num_in_flight} request(s) are in flight; drain the replica (POST /drain) and sleep "
                    "once it is idle.",
                )
            started = time.monotonic()
            try:
                freed = await engine.sleep(level)
            except SleepModeError as exc:
                ctx.sleeping = bool(engine.sleep_level)
                raise APIError(409, str(exc)) from None
            ctx.metrics.refresh_load(engine.queue_snapshot(), engine.service_rates(), engine.sleep_level)
            return JSONResponse(
                {"is_sleeping": True, "level": engine.sleep_level, "freedBytes": freed,
                 "seconds": round(time.monotonic() - started, 4)}
            )  # fmt: skip

    @app.post("/wake_up")
    async def wake_up() -> Response:
        if not engine.config.enable_sleep_mode:
            raise APIError(400, "Sleep mode is off on this server; start it with --enable-sleep-mode.")
        async with lock:
            took = await engine.wake_up() if engine.is_ready else 0.0
            ctx.sleeping = False
            ctx.metrics.refresh_load(engine.queue_snapshot(), engine.service_rates(), engine.sleep_level)
            return JSONResponse({"is_sleeping": False, "seconds": round(took, 4)})

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return JSONResponse({"is_sleeping": ctx.sleeping or bool(engine.is_ready and engine.sleep_level)})
