"""Client-supplied chat templates, rendered in a small pool of worker processes.

What it is: :class:`TemplatePool`, used only with ``--allow-client-chat-template``.
A user's Jinja template is arbitrary CPU work (``range(400)`` nested three deep,
``'ab ' * 7000000``); rendered on a thread of the server it would hold the
interpreter lock and starve the event loop, so ``/health`` would stall. Here each
render runs in its own process with a time budget (past it the process is killed
and replaced, the request gets a 400), an output budget (a text longer than any
prompt the model can hold is refused, a 400) and a memory cap. The event loop only
waits on a pipe.

What it is not: the model's own chat template, which is trusted and renders in a
thread (``prompts.py``), or tokenising.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from plimsoll.runtime.serving import template_worker
from plimsoll.runtime.serving.errors import APIError, bad_request

log = logging.getLogger(__name__)

WORKER_MEMORY_BYTES = 1 << 30  # address space a render may add on top of the worker's own
START_TIMEOUT_S = 120.0  # a worker imports the chat-template renderer (jinja2) before it says ready


class _Worker:
    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn

    def kill(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.process.kill()
        with contextlib.suppress(OSError):
            self.conn.close()


async def _recv(conn: Connection) -> Any:
    """The next message on ``conn``, waiting on the event loop (not a thread) for it to arrive."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    fd = conn.fileno()

    def arrived() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(fd, arrived)
    try:
        await readable
    finally:
        loop.remove_reader(fd)
    return conn.recv()  # the worker writes a reply in one go; its bytes are already arriving


class TemplatePool:
    """``num_workers`` renderer processes; a render waits for a free one (429 after ``timeout``),
    then has ``timeout`` seconds to finish (400 after, and its process is killed)."""

    def __init__(self, num_workers: int = 2, memory_bytes: int = WORKER_MEMORY_BYTES) -> None:
        self.num_workers = num_workers
        self.memory_bytes = memory_bytes
        self._mp = multiprocessing.get_context("spawn")  # never fork a process that runs the engine thread
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._workers: set[_Worker] = set()
        self._starting: set[asyncio.Task[None]] = set()
        self._closed = False
        self.is_started = False  # every first worker reported ready (/ready waits for it)
        self._num_first = 0

    @property
    def num_idle(self) -> int:
        """Workers ready and waiting for a render."""
        return self._idle.qsize()

    @property
    def pids(self) -> set[int]:
        return {w.process.pid for w in self._workers if w.process.pid is not None}

    def start(self) -> None:
        """Spawn the workers; each joins the idle queue once it is ready (a call on the event loop)."""
        for _ in range(self.num_workers):
            self._spawn()

    def _spawn(self) -> None:
        if self._closed:
            return
        parent, child = self._mp.Pipe()
        process = self._mp.Process(
            target=template_worker.main, args=(child, self.memory_bytes), name="plimsoll-template", daemon=True
        )
        process.start()
        child.close()
        worker = _Worker(process, parent)
        self._workers.add(worker)
        task = asyncio.ensure_future(self._wait_ready(worker))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _wait_ready(self, worker: _Worker) -> None:
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await _recv(worker.conn)
        except (TimeoutError, EOFError, OSError) as exc:
            log.error("a chat-template worker did not start (%r); rendering has one worker less", exc)
            self._retire(worker)
            self.is_started = True  # serve with what started; render() says 503 if none did
            return
        self._idle.put_nowait(worker)
        self._num_first += 1
        self.is_started = self.is_started or self._num_first >= self.num_workers

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.discard(worker)

    async def render(self, template: str, context: dict[str, Any], max_chars: int, timeout: float) -> str:
        """The rendered text, or a 400 (too slow, too long, template error) / 503 (every worker busy)."""
        if self._closed or not self._workers:
            raise APIError(503, "Client chat templates cannot be rendered now (no template worker); retry.")
        try:
            async with asyncio.timeout(timeout):
                worker = await self._idle.get()
        except TimeoutError:
            raise APIError(
                429,
                f"All {self.num_workers} chat-template workers stayed busy for {timeout:g}s; retry after 1s, "
                "or leave chat_template out to use the model's own.",
                headers={"Retry-After": "1"},
            ) from None
        clean = False
        try:
            worker.conn.send((template, context, max_chars))
            async with asyncio.timeout(timeout):
                kind, value = await _recv(worker.conn)
            clean = True
        except TimeoutError:
            log.warning("a client chat template ran past %gs; its worker is killed and replaced", timeout)
            raise bad_request(
                f"Rendering the client-supplied chat_template took longer than {timeout:g}s and was stopped; "
                "send a simpler template (or none, to use the model's own).",
                "chat_template_kwargs",
            ) from None
        except (EOFError, OSError):
            # The worker died mid-render: the memory cap, or a crash in the renderer.
            raise bad_request(
                "Rendering the client-supplied chat_template exhausted its worker's memory budget; "
                "send a template whose output is smaller.",
                "chat_template_kwargs",
            ) from None
        finally:
            if clean:
                self._idle.put_nowait(worker)
            else:  # killed on overrun, cancelled by a client that left, or dead: replace it
                self._retire(worker)
                self._spawn()
        if kind == "ok":
            return str(value)
        if kind == "too_long":
            size = f"{value} characters" if value >= 0 else "more than its memory budget"
            raise bad_request(
                f"The client-supplied chat_template rendered {size}; this server accepts at most "
                f"{max_chars} (a prompt longer cannot fit the model's context); send a smaller template.",
                "chat_template_kwargs",
            )
        raise bad_request(f"The chat template rejected these messages: {value}", "messages")

    async def close(self) -> None:
        self._closed = True
        for task in list(self._starting):
            task.cancel()
        await asyncio.gather(*self._starting, return_exceptions=True)
        workers, self._workers = list(self._workers), set()
        for worker in workers:
            worker.kill()
        for worker in workers:
            await asyncio.to_thread(worker.process.join, 5)
