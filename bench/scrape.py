"""Reading a server's Prometheus ``/metrics`` during a level or a diagnose window.

What it is: timed :class:`Snapshot` objects of a server's exposition (read by
:mod:`plimsoll.prometheus`, whose histograms give the quantiles), deltas between
snapshots, and a :class:`Scraper` task that polls while load runs. Either engine family works: the
names come from :mod:`plimsoll.metric_names` and the family is detected from the
scrape. What it is not: a Prometheus server; nothing is stored beyond one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from plimsoll.metric_names import BATCH_SIZE, HTTP_CONNECTIONS, STEP_TOKENS, EngineMetricNames, detect_family
from plimsoll.prometheus import Histogram, Scrape, parse


@dataclass(slots=True)
class Snapshot:
    """One scrape at time ``t``: every sample, and each name summed over its label sets."""

    t: float
    scrape: Scrape = field(default_factory=lambda: Scrape({}))
    values: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float | None:
        return self.values.get(name)


def parse_metrics(text: str, t: float | None = None) -> Snapshot:
    """Read exposition text; raises :class:`plimsoll.prometheus.ExpositionError` (a ValueError) on bad text."""
    scrape = parse(text)
    return Snapshot(time.monotonic() if t is None else t, scrape, scrape.sums())


async def fetch(http: httpx.AsyncClient, url: str) -> Snapshot:
    """GET ``url``/metrics and parse it; raises httpx errors to the caller."""
    response = await http.get(f"{url}/metrics", timeout=10.0)
    response.raise_for_status()
    return parse_metrics(response.text)


def family_of(snap: Snapshot) -> EngineMetricNames | None:
    return detect_family(set(snap.values))


def counter_delta(a: Snapshot, b: Snapshot, name: str) -> float | None:
    """Increase of a counter between scrapes; None when the server lacks it."""
    if name not in b.values:
        return None
    return max(0.0, b.values[name] - a.values.get(name, 0.0))


def histogram_delta(a: Snapshot, b: Snapshot, name: str) -> Histogram | None:
    """What histogram ``name`` observed between two scrapes (all label sets); None when the server lacks it."""
    now = b.scrape.histogram(name)
    return None if now is None else now.delta(a.scrape.histogram(name))


def gauge_summary(samples: list[Snapshot], name: str) -> dict[str, float] | None:
    values = [s.values[name] for s in samples if name in s.values]
    if not values:
        return None
    arr = np.asarray(values)
    return {
        "mean": float(arr.mean()),
        "p95": float(np.percentile(arr, 95)),
        "max": float(arr.max()),
        "last": float(arr[-1]),
        "samples": len(values),
    }


class Scraper:
    """Polls ``/metrics`` every ``interval`` seconds while a level runs."""

    def __init__(self, url: str, interval: float, headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.interval = interval
        self.samples: list[Snapshot] = []
        self.error: str | None = None
        self._http = httpx.AsyncClient(headers=headers or {})
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        while True:
            try:
                self.samples.append(await fetch(self._http, self.url))
            except (httpx.HTTPError, ValueError) as exc:
                # A server without /metrics is still benchmarkable; say so once.
                self.error = f"{type(exc).__name__}: {exc}"
                return
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self.samples = []
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict[str, Any] | None:
        """Stop polling and summarise the server's gauges and counters for the level."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(httpx.HTTPError, ValueError):
            self.samples.append(await fetch(self._http, self.url))
        return summarize_server(self.samples)

    async def aclose(self) -> None:
        await self._http.aclose()


def _mean_ms(h: Histogram | None) -> float | None:
    return None if h is None or h.mean is None else h.mean * 1e3


def load_from_histograms(first: Snapshot, last: Snapshot, fam: EngineMetricNames) -> dict[str, Any]:
    """What the server's own histograms say about the load between two scrapes.

    By Little's law over the requests finished between them: mean requests waiting
    = Σ queue time / elapsed, mean running = Σ (E2E − queue time) / elapsed. Step
    time is the server's mean inter-token latency (one decode step per token);
    batch and tokens per step come from plimsoll's per-step histograms (vLLM has
    none); the prefill rate is prompt tokens over the summed prefill time. Sums, not sampled gauges, so a level of a second is not two samples.
    """
    span = last.t - first.t
    queue = histogram_delta(first, last, fam.queue_time)
    e2e = histogram_delta(first, last, fam.e2e)
    itl = histogram_delta(first, last, fam.itl)
    batch = histogram_delta(first, last, BATCH_SIZE)
    step_tokens = histogram_delta(first, last, STEP_TOKENS)
    prefill = histogram_delta(first, last, fam.prefill_time)
    prompt_tokens = counter_delta(first, last, fam.prompt_tokens)
    out: dict[str, Any] = {
        "span_s": span,
        "requests_finished": None if e2e is None else e2e.count,
        "queue_time_mean_ms": _mean_ms(queue),
        "e2e_mean_ms": _mean_ms(e2e),
        "step_time_ms": _mean_ms(itl),
        "waiting_mean": None,
        "running_mean": None,
        "batch_mean": None if batch is None else batch.mean,
        "step_tokens_mean": None if step_tokens is None else step_tokens.mean,
        # Prompt tokens over the time requests spent in prefill (what a prefill/decode split's
        # prediction reads: plimsoll.disaggregation); prefix-cache hits make it read high.
        "prefill_tokens_per_s": prompt_tokens / prefill.sum
        if prefill is not None and prompt_tokens and prefill.sum > 0 else None,
    }
    if span > 0 and queue is not None and e2e is not None and e2e.count > 0:
        out["waiting_mean"] = queue.sum / span
        out["running_mean"] = max(0.0, e2e.sum - queue.sum) / span
    return out


def summarize_server(samples: list[Snapshot]) -> dict[str, Any] | None:
    """Running, waiting, KV usage (mean/p95/max), preemptions and the histogram view of the load."""
    if len(samples) < 1:
        return None
    fam = family_of(samples[-1])
    if fam is None:
        return None
    first, last = samples[0], samples[-1]
    return {
        "load": load_from_histograms(first, last, fam),
        "engine_family": "vllm" if fam.running.startswith("vllm:") else "plimsoll",
        "running": gauge_summary(samples, fam.running),
        "waiting": gauge_summary(samples, fam.waiting),
        "kv_usage": gauge_summary(samples, fam.kv_usage),
        "preemptions": counter_delta(first, last, fam.preemptions),
        "resident_memory_bytes": gauge_summary(samples, "process_resident_memory_bytes"),
        "open_fds": gauge_summary(samples, "process_open_fds"),
        "http_connections": gauge_summary(samples, HTTP_CONNECTIONS),
    }
