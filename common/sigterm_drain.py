"""A uvicorn server whose first SIGTERM starts a drain instead of stopping it.

What it is: :class:`SigtermDrainServer`, what the router (``router/lifecycle.py``) and a
serving replica (``runtime/serving/lifecycle.py``) share: the first SIGTERM sets the
``draining`` flag of the object given (``/ready`` then answers 503) and runs the subclass's
``_drain`` on the event loop, once; ``_drain`` ends by setting ``should_exit``, so the
process exits 0. A second SIGTERM, or SIGINT, stops at once, as uvicorn does.
:meth:`begin_drain` takes the same path without a signal.

What it is not: either drain (how long to keep serving, what to cut): the subclasses say.
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType
from typing import Any

import uvicorn


class SigtermDrainServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, flagged: Any) -> None:
        super().__init__(config)
        self._flagged = flagged  # its ``draining`` attribute turns /ready to 503
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self._flagged.draining and self._loop is not None:
            # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and
            # the process would die by SIGTERM instead of exiting 0.
            self._flagged.draining = True
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def begin_drain(self) -> None:
        """Drain as on SIGTERM; callable from the event loop or any thread."""
        self._flagged.draining = True
        if self._loop is None:
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        """Serve on while draining, then set ``should_exit``."""
        raise NotImplementedError
