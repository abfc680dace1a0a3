"""Live SLO attainment: the operator's figure against the load generator's own records.

A real plimsoll server (tiny model, every step slowed so the test does not
depend on this CPU's speed), told the SLO by the operator's own handler
(``PUT /slo``), loaded by bench's closed-loop generator; the operator's
``plimsoll_operator_slo_attainment_ratio`` must match the fraction of the
generator's records that meet the SLO (bench's ``meets_slo``) within 2
percentage points. With ``max_num_seqs`` 4 under 6 clients the requests run in
waves: of each wave's arrivals some start at once and the rest wait a whole
wave, so first tokens come after about one step or about one wave. The bound is
put in the widest gap of a pilot run's TTFTs, so both good and bad requests
occur and few sit near the bound (where the client's and the server's clocks
may disagree by the HTTP overhead). Steps of 80 ms keep that gap (one step against
one wave of eight) wide beside the scheduling noise of a loaded host.
"""

import asyncio
import itertools
import logging

import httpx
import pytest
from prometheus_client import REGISTRY

from plimsoll.bench.client import OpenAIClient
from plimsoll.bench.config import SLO, BenchConfig, LengthSpec
from plimsoll.bench.loadgen import run_concurrency
from plimsoll.bench.stats import meets_slo
from plimsoll.bench.workload import Workload
from plimsoll.operator.api.llmservice import LLMService
from plimsoll.operator.handlers.attainment import AttainmentState, track_attainment
from plimsoll.operator.scaling.attainment import AttainmentTracker
from plimsoll.operator.scaling.metrics import PodSample, parse_scrape
from plimsoll.runtime.testing import ThreadedServer, write_tiny_model

LOG = logging.getLogger("test")


def bench_config(url: str, requests: int) -> BenchConfig:
    return BenchConfig(
        url=url, model="tiny", levels=(6,), requests_per_level=requests,
        input_tokens=LengthSpec(value=8), output_tokens=LengthSpec(value=8), ignore_eos=True,
        max_client_lag_ms=1e9, min_concurrency_ratio=0.01,
    )  # fmt: skip


async def load(url: str, cfg: BenchConfig) -> list:  # type: ignore[type-arg]
    async with httpx.AsyncClient() as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
    client = OpenAIClient(cfg, model=model)
    try:
        run = await run_concurrency(client, Workload(cfg), cfg, 6)
    finally:
        await client.aclose()
    return run.records


def widest_gap_ms(ttfts_s: list[float]) -> float:
    ordered = sorted(ttfts_s)
    _, low, high = max((b - a, a, b) for a, b in itertools.pairwise(ordered))
    return (low + high) / 2 * 1000


async def scrape(http: httpx.AsyncClient, url: str) -> dict[str, PodSample]:
    return {"pod-a": parse_scrape((await http.get(f"{url}/metrics")).text)}


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> ThreadedServer:
    model = write_tiny_model(tmp_path_factory.getbasetemp() / "plimsoll-attainment-tiny")
    srv = ThreadedServer(
        model, step_delay=0.08, max_model_len=256, kv_cache_memory="4MiB", max_num_seqs=4
    ).start()
    yield srv
    srv.stop()


def test_attainment_matches_the_load_generators_records(slow_server: ThreadedServer) -> None:
    url = slow_server.url

    async def scenario() -> tuple[float | None, list, float]:  # type: ignore[type-arg]
        pilot = await load(url, bench_config(url, 24))
        failed = {r.error_kind for r in pilot if not r.ok}
        assert not failed, f"pilot requests failed: {failed}"
        bound_ms = widest_gap_ms([r.ttft for r in pilot if r.ok and r.ttft is not None])
        svc = LLMService.from_body({
            "metadata": {"name": "chat", "namespace": "team-a"},
            "spec": {"model": {"uri": "hf://org/tiny"}, "slo": {"ttftP95Ms": bound_ms}},
        })  # fmt: skip
        state = AttainmentState()
        async with httpx.AsyncClient(timeout=10) as http:
            base = {"pod-a": url}
            # Tick 1 tells the replica the SLO; from tick 2 its counters are the tracker's.
            await track_attainment(http, svc, state, await scrape(http, url), base, 1, 0.0, LOG)
            assert (await http.get(f"{url}/slo")).json()["ttftP95Ms"] == pytest.approx(bound_ms)
            await track_attainment(http, svc, state, await scrape(http, url), base, 1, 1.0, LOG)
            records = await load(url, bench_config(url, 96))
            await asyncio.sleep(0.2)  # the last request's counters are written after its final chunk
            ratio = await track_attainment(http, svc, state, await scrape(http, url), base, 1, 40.0, LOG)
        return ratio, records, bound_ms

    ratio, records, bound_ms = asyncio.run(scenario())
    # Every request of the measured run, its warm-up ones included: the server judged them all.
    good = [r for r in records if meets_slo(r, SLO(ttft_p95_ms=bound_ms))]
    expected = len(good) / len(records)
    assert 0 < len(good) < len(records), "the bound should split the requests into good and bad"
    assert ratio is not None and abs(ratio - expected) <= 0.02, (ratio, expected)
    exported = REGISTRY.get_sample_value(
        "plimsoll_operator_slo_attainment_ratio",
        {"namespace": "team-a", "llmservice": "chat", "window": "1m"},
    )
    assert exported == ratio


def test_counts_over_a_window_survive_restarts_and_price_replica_seconds() -> None:
    tracker = AttainmentTracker(objectives={"ttft": 0.5})

    def sample(good: float, bad: float) -> PodSample:
        return PodSample(
            "plimsoll", 0, 0, 0, None, None, slo_good=good, slo_bad=bad, slo_objectives={"ttft": 0.5}
        )

    tracker.observe(0.0, {"a": sample(0, 0)}, replicas=2)
    tracker.observe(30.0, {"a": sample(90, 10), "b": sample(5, 5)}, replicas=2)
    # "a" restarted: its 20 requests since are all in the window.
    tracker.observe(60.0, {"a": sample(18, 2), "b": sample(15, 5)}, replicas=2)
    assert tracker.counted(60.0) == (33.0, 40.0)
    assert tracker.attainment(60.0) == 33.0 / 40.0
    assert tracker.replica_seconds(60.0) == 120.0
    assert tracker.replica_seconds_per_1k_good(60.0) == pytest.approx(120.0 / 0.033)
    # A replica told other bounds (an older SLO) is not counted.
    stale = PodSample("plimsoll", 0, 0, 0, None, None, slo_good=1000, slo_bad=0, slo_objectives={"ttft": 9.0})
    tracker.observe(90.0, {"a": sample(18, 2), "c": stale}, replicas=3)
    assert tracker.counted(30.0) == (0.0, 0.0)
