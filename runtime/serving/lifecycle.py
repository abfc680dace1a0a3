"""The process lifecycle Kubernetes sees: start the engine, drain on SIGTERM, exit 0.

What it is: :class:`DrainingServer`, a uvicorn ``Server`` whose first SIGTERM
does not close the listening socket. Instead the replica keeps answering (so
``/ready`` can report 503 and new requests get a clear 503 instead of a refused
connection), lets in-flight requests finish for up to ``drain_timeout`` seconds,
then shuts uvicorn down and the process exits 0. At the deadline every request
still running is cut by the engine: a stream ends with an error event and
``[DONE]`` (status ``shutdown`` in the request log), a non-streaming request gets
a 503, so ``--drain-timeout`` is the whole budget (uvicorn's own graceful wait only
closes sockets after that). A second SIGTERM or SIGINT stops at once, as uvicorn
normally does. :meth:`DrainingServer.begin_drain` is the same path without a
signal, taken when the engine dies (the CLI then exits 1).

What it is not: the engine's own shutdown (the app's lifespan calls
``engine.shutdown()`` after the server stops).
"""

from __future__ import annotations

import logging

import uvicorn

from plimsoll.runtime.serving.requests import ServingContext
from plimsoll.sigterm_drain import SigtermDrainServer

log = logging.getLogger("plimsoll.runtime.serving.server")

CUT_GRACE_S = 1.0  # after the drain deadline, for cut streams to send their last event


class DrainingServer(SigtermDrainServer):
    def __init__(self, config: uvicorn.Config, ctx: ServingContext) -> None:
        super().__init__(config, ctx)
        self.ctx = ctx
        metrics = getattr(ctx, "metrics", None)
        if metrics is not None:
            metrics.watch_connections(lambda: len(self.server_state.connections))

    async def _drain(self) -> None:
        n = self.ctx.num_in_flight
        timeout = self.ctx.settings.drain_timeout
        log.info("SIGTERM: draining, %d request(s) in flight, waiting up to %.0fs", n, timeout)
        if await self.ctx.wait_idle(timeout):
            log.info("drained; shutting down")
        else:
            self.ctx.metrics.cut_by_shutdown_add(self.ctx.num_in_flight)
            log.warning(
                "drain timeout: %d request(s) still in flight after %gs are cut off",
                self.ctx.num_in_flight,
                timeout,
            )
            self.ctx.drain_deadline_passed = True
            engine = getattr(self.ctx, "engine", None)  # a bare context (tests) has no engine to cut
            if engine is not None:
                engine.cut_streams()
            # The cut streams write their error event and [DONE] and close; this only bounds
            # a client that stopped reading.
            await self.ctx.wait_idle(CUT_GRACE_S)
        self.should_exit = True
