"""Router test harness: bench-simulator replicas in their own processes on 127.0.0.1, and an in-loop router."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from plimsoll.bench.simulator import ServiceCurve, SimulatorProcess, free_port, spawn_simulator
from plimsoll.prometheus import parse
from plimsoll.router.app import RouterState, running_router
from plimsoll.router.config import RouterConfig

__all__ = ["fake_replicas", "free_port", "replica_metric", "route_process", "run_router"]

# What the router tests' replicas default to: model "fake", 5 ms per token, 8 at once.
REPLICA_DEFAULTS: dict[str, Any] = {"model": "fake", "step_t0_s": 0.005, "batch_cap": 8}


def replica_metric(replica: SimulatorProcess, name: str) -> float:
    """A replica's series ``name`` summed over its label sets, 0 when it has none yet."""
    return parse(httpx.get(f"{replica.url}/metrics", timeout=5).text).sum(name) or 0.0


@pytest.fixture
def fake_replicas() -> Iterator[Any]:
    """``spawn([curve_fields_for_replica_0, ...]) -> [SimulatorProcess]``; bench simulators, all killed at teardown.

    Each replica is a :class:`ServiceCurve` of ``REPLICA_DEFAULTS`` updated with its own fields,
    in its own process so a test can SIGKILL it.
    """
    started: list[SimulatorProcess] = []

    def spawn(per_replica: Sequence[Mapping[str, Any]]) -> list[SimulatorProcess]:
        batch = [spawn_simulator(ServiceCurve(**{**REPLICA_DEFAULTS, **fields})) for fields in per_replica]
        started.extend(batch)
        for replica in batch:
            replica.wait_ready(timeout_s=60)
        return batch

    yield spawn
    for replica in started:
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
    async with running_router(RouterConfig(port=0, **config)) as (url, state):
        yield RunningRouter(url, state)


@contextlib.contextmanager
def route_process(
    args: Sequence[str], env: Mapping[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`plimsoll route ARGS` as its own process on a free port, yielded once ``/ready`` answers 200;
    SIGTERM at the end. Yields the router's URL and the process (its output is read after it exits)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", "from plimsoll.cli import main; main()", "route", "--port", str(port), *args],
        env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[0].decode()
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "plimsoll route never became ready"
            time.sleep(0.1)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
