"""Router test harness: replica processes on 127.0.0.1 and an in-loop router on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from plimsoll.router.app import RouterState, build_app
from plimsoll.router.config import RouterConfig

FAKE_REPLICA = Path(__file__).with_name("fake_replica.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class FakeReplica:
    url: str
    process: subprocess.Popen[bytes]

    def kill(self) -> None:
        """SIGKILL: the process dies with its connections, as a crashed pod does."""
        self.process.kill()
        self.process.wait()

    def metric(self, name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def wait_ready(urls: Sequence[str], processes: Sequence[subprocess.Popen[bytes]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    pending = list(zip(urls, processes, strict=True))
    while pending:
        url, process = pending[0]
        if process.poll() is not None:
            raise RuntimeError(f"replica {url} exited with {process.returncode} before /health")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {url} not ready after {timeout}s")
        time.sleep(0.05)


@pytest.fixture
def fake_replicas() -> Iterator[Any]:
    """``spawn([args_for_replica_0, args_for_replica_1, ...]) -> [FakeReplica]``; all killed at teardown."""
    started: list[FakeReplica] = []

    def spawn(per_replica_args: Sequence[Sequence[str]]) -> list[FakeReplica]:
        batch = []
        for args in per_replica_args:
            port = free_port()
            process = subprocess.Popen(
                [sys.executable, str(FAKE_REPLICA), "--port", str(port), *args],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            batch.append(FakeReplica(f"http://127.0.0.1:{port}", process))
        started.extend(batch)
        wait_ready([r.url for r in batch], [r.process for r in batch])
        return batch

    yield spawn
    for replica in started:
        if replica.process.poll() is None:
            replica.kill()


@dataclass
class RunningRouter:
    url: str
    state: RouterState

    def metric(self, name: str, **labels: str) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels)
        return value or 0.0


async def eventually(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Let the event loop run until ``predicate()`` holds (a marker, not a guess at timing); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def run_router(**config: Any) -> AsyncIterator[RunningRouter]:
    """A real router (uvicorn, real sockets) inside the test's event loop."""
    app = build_app(RouterConfig(port=0, **config))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws="none",
                                           lifespan="on"))
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 30
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("router exited before it started")
        if time.monotonic() > deadline:
            raise TimeoutError("router did not start in 30 s")
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningRouter(f"http://127.0.0.1:{port}", app.state.router)
    finally:
        server.should_exit = True
        await task
