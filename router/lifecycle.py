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
from typing import Any

import uvicorn

from plimsoll.sigterm_drain import SigtermDrainServer

log = logging.getLogger(__name__)


class DrainingRouter(SigtermDrainServer):
    def __init__(self, config: uvicorn.Config, state: Any, shutdown_delay_s: float) -> None:
        super().__init__(config, state)
        self.state = state  # the app's RouterState: its ``draining`` flag turns /ready to 503
        self.shutdown_delay_s = shutdown_delay_s

    async def _drain(self) -> None:
        log.info(
            "SIGTERM: /ready reports 503; serving %.0f s more while endpoints update, then closing the "
            "listener and finishing open streams (up to %s s)",
            self.shutdown_delay_s,
            self.config.timeout_graceful_shutdown,
        )
        await asyncio.sleep(self.shutdown_delay_s)
        self.should_exit = True
