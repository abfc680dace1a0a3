"""How a router replica leaves without failing a request: SIGTERM drains it, then it exits 0.

What it is: :class:`DrainingRouter`, a uvicorn ``Server`` whose first SIGTERM does not
stop it at once. The router first reports ``/ready`` 503 and keeps serving everything,
new requests included, for ``--shutdown-delay`` seconds: Kubernetes takes a terminating
pod out of its Service's endpoints, but kube-proxies and clients learn it a moment later,
and a request reaching a router that already closed its socket would fail. Then it stops
accepting connections and lets the streams it carries finish for up to
``--drain-timeout`` seconds (uvicorn's graceful shutdown), and exits 0. A second SIGTERM
or a SIGINT stops at once, as uvicorn does.

What it is not: the replicas' drain (``runtime/serving/lifecycle.py``); a router holds no
engine state, only open streams.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger(__name__)


class DrainingRouter(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any, shutdown_delay_s: float) -> None:
        super().__init__(config)
        self.state = state  # the app's RouterState: its ``draining`` flag turns /ready to 503
        self.shutdown_delay_s = shutdown_delay_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.state.draining and self._loop is not None:
            # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and
            # the process would die by SIGTERM instead of exiting 0.
            self.state.draining = True
            self._loop.call_soon_threadsafe(self._begin_drain)
            return
        super().handle_exit(sig, frame)

    def begin_drain(self) -> None:
        """Drain as on SIGTERM; callable from any thread (tests, and the signal path)."""
        self.state.draining = True
        if self._loop is None:
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._stop_after_delay())

    async def _stop_after_delay(self) -> None:
        log.info(
            "SIGTERM: /ready reports 503; serving %.0f s more while endpoints update, then closing the "
            "listener and finishing open streams (up to %s s)",
            self.shutdown_delay_s,
            self.config.timeout_graceful_shutdown,
        )
        await asyncio.sleep(self.shutdown_delay_s)
        self.should_exit = True
