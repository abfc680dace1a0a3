"""Load generation: closed-loop concurrency levels and open-loop arrival schedules.

What it is: coroutines that drive an :class:`OpenAIClient` and return a
:class:`LevelRun` (every record, the measurement window, event-loop lag samples,
the server scrape summary). Closed loop: ``c`` workers, each sending its next
request when the previous one ends; the first ``warmup`` completions are excluded
and the window closes at the N-th measured send (request mode; with a duration
floor, at the first send after both the count and the floor are reached) or after
a duration, while every worker is still busy, so the window is at full concurrency.
Open loop: requests start at scheduled offsets (constant, Poisson, gamma bursts)
regardless of completions; lateness is recorded as send lag. What it is not:
statistics (stats.py) or knees (knees.py).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from plimsoll.bench.client import OpenAIClient, RequestRecord
from plimsoll.bench.config import BenchConfig
from plimsoll.bench.scrape import Scraper
from plimsoll.bench.workload import Workload

Progress = Callable[[int, int], None]  # (completed, failed)
Arrival = Literal["constant", "poisson", "bursty"]


@dataclass(slots=True)
class LevelRun:
    """One execution of one level (a repeat)."""

    concurrency: int | None
    rate: float | None
    repeat: int
    origin: float
    window_start: float
    window_end: float
    records: list[RequestRecord]
    loop_lag: list[float] = field(default_factory=list)
    server: dict[str, Any] | None = None
    scrape_error: str | None = None

    @property
    def measured(self) -> list[RequestRecord]:
        return [r for r in self.records if r.measured]


class LagMonitor:
    """Measures how late the event loop wakes up: the client's own saturation."""

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.period)
            self.samples.append(max(0.0, time.perf_counter() - t - self.period))

    def __enter__(self) -> LagMonitor:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *_: object) -> None:
        if self._task is not None:
            self._task.cancel()


async def _scraped(scraper: Scraper | None, run: LevelRun) -> LevelRun:
    if scraper is not None:
        run.server = await scraper.stop()
        run.scrape_error = scraper.error
    return run


async def run_concurrency(
    client: OpenAIClient,
    workload: Workload,
    cfg: BenchConfig,
    concurrency: int,
    repeat: int = 0,
    scraper: Scraper | None = None,
    progress: Progress | None = None,
) -> LevelRun:
    """Closed loop at ``concurrency`` clients with no think time."""
    target = cfg.measured_requests(concurrency)
    duration = cfg.duration_per_level_s
    floor = cfg.min_duration_per_level_s or None  # request mode: the count and at least this long
    warmup = cfg.warmup_for(concurrency)
    records: list[RequestRecord] = []
    origin = time.perf_counter()
    state: dict[str, Any] = {
        "start": origin if warmup == 0 else None,
        "end": None,
        "full": None,
        "issued": 0,
        "done": 0,
        "failed": 0,
    }

    def may_send(now: float) -> bool:
        start = state["start"]
        if start is None:
            return True
        if state["end"] is not None:
            return False
        if duration is not None and now >= start + duration:
            # At least one measured request per client, or a slow server yields a handful of samples.
            if state["issued"] < concurrency:
                return True
            state["end"] = max(start + duration, state["full"] or start)
            return False
        if target is None or state["issued"] < target:
            return True
        if floor is not None and now < start + floor:
            return True  # the count is reached, the floor is not: keep the level at full concurrency
        if state["end"] is None:
            state["end"] = now
        return False

    async def worker() -> None:
        scheduled = time.perf_counter()
        while may_send(time.perf_counter()):
            measured = state["start"] is not None
            rec = RequestRecord(len(records), scheduled, measured=measured)
            records.append(rec)
            if measured:
                state["issued"] += 1
                if state["issued"] == concurrency:
                    state["full"] = time.perf_counter()
                if target is not None and state["issued"] == target and duration is None and floor is None:
                    state["end"] = time.perf_counter()
            await client.send(workload.next(), rec)
            state["done"] += 1
            if not rec.ok:
                state["failed"] += 1
                await asyncio.sleep(0.01)  # do not hot-loop against a failing server
            if state["start"] is None and state["done"] >= warmup:
                state["start"] = time.perf_counter()
            if progress is not None:
                progress(state["done"], state["failed"])
            scheduled = time.perf_counter()

    if scraper is not None:
        scraper.start()
    with LagMonitor() as lag:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    start = state["start"] if state["start"] is not None else origin
    end = state["end"] if state["end"] is not None else time.perf_counter()
    run = LevelRun(concurrency, None, repeat, origin, start, end, records, lag.samples)
    return await _scraped(scraper, run)


def arrival_offsets(
    rate: float, duration_s: float, arrival: Arrival, burstiness: float = 0.5, seed: int = 0
) -> list[float]:
    """Start offsets (seconds) for an open-loop schedule of ``rate`` requests/s.

    ``poisson``: exponential gaps. ``bursty``: gamma gaps with shape ``burstiness``
    (< 1 is burstier than Poisson) and the same mean. ``constant``: even spacing.
    """
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    rng = random.Random(seed)
    offsets: list[float] = []
    t = 0.0
    while True:
        if arrival == "constant":
            gap = 1.0 / rate
        elif arrival == "poisson":
            gap = rng.expovariate(rate)
        else:
            gap = rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        t += gap
        if t > duration_s:
            return offsets
        offsets.append(t)


async def run_schedule(
    client: OpenAIClient,
    workload: Workload,
    offsets: list[float],
    window: tuple[float, float],
    rate: float | None = None,
    repeat: int = 0,
    max_concurrency: int | None = None,
    scraper: Scraper | None = None,
    progress: Progress | None = None,
) -> LevelRun:
    """Open loop: start one request at each offset; measure those scheduled in ``window``."""
    records: list[RequestRecord] = []
    origin = time.perf_counter()
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    counts = {"done": 0, "failed": 0}

    async def one(rec: RequestRecord) -> None:
        if gate is not None:
            async with gate:
                await client.send(workload.next(), rec)
        else:
            await client.send(workload.next(), rec)
        counts["done"] += 1
        counts["failed"] += 0 if rec.ok else 1
        if progress is not None:
            progress(counts["done"], counts["failed"])

    tasks = []
    if scraper is not None:
        scraper.start()
    with LagMonitor() as lag:
        for off in offsets:
            due = origin + off
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = RequestRecord(len(records), due, measured=window[0] <= off < window[1])
            records.append(rec)
            tasks.append(asyncio.create_task(one(rec)))
        await asyncio.gather(*tasks)
    run = LevelRun(
        max_concurrency, rate, repeat, origin, origin + window[0], origin + window[1], records, lag.samples
    )
    return await _scraped(scraper, run)
