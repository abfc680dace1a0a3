"""Live SLO attainment: the operator's figure against the load generator's own records.

A real plimsoll server (tiny model, every step slowed so the test does not
depend on this CPU's speed), told the SLO by the operator's own handler
(``PUT /slo``), loaded by bench's closed-loop generator. The operator's
``plimsoll_operator_slo_attainment_ratio`` must be the share of the measured
run's requests whose TTFT (from the server's one log line per request) met the
bound, and the load generator's records must agree with it the only way two
clocks can: the server starts timing when the request arrives and stops at the
first token, the client starts before it sends and stops at the first chunk of
text, so every server TTFT is at most the client's (sorted, each server figure at
most the client's of the same rank) and the server counts good at least the
requests the client saw meet the bound. The client's first text can come steps
after the first token (a token that is a piece of a character sends no text; the
tiny model's vocabulary is full of them), so the client's figure bounds the
operator's from below only. With ``max_num_seqs`` 4 under 6 clients requests
queue for up to a wave, so TTFTs spread over many steps; the bound is put in the
widest gap of the central half of a pilot run's TTFTs so both good and bad
requests occur.
"""

import asyncio
import contextlib
import itertools
import json
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


STEP_DELAY_S = 0.08  # a step long beside the scheduling noise of a loaded host


def widest_gap_ms(ttfts_s: list[float]) -> float:
    """The middle of the widest gap between neighbouring TTFTs in the central half."""
    ordered = sorted(ttfts_s)
    ordered = ordered[len(ordered) // 4 : len(ordered) - len(ordered) // 4]
    _, low, high = max((b - a, a, b) for a, b in itertools.pairwise(ordered))
    return (low + high) / 2 * 1000


async def scrape(http: httpx.AsyncClient, url: str) -> dict[str, PodSample]:
    return {"pod-a": parse_scrape((await http.get(f"{url}/metrics")).text)}


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> ThreadedServer:
    model = write_tiny_model(tmp_path_factory.getbasetemp() / "plimsoll-attainment-tiny")
    srv = ThreadedServer(
        model, step_delay=STEP_DELAY_S, max_model_len=256, kv_cache_memory="4MiB", max_num_seqs=4
    ).start()
    yield srv
    srv.stop()


class RequestLines(logging.Handler):
    """The server's ``request_finished`` log lines (``serving/requests.py``, logger
    ``plimsoll.runtime.requests``), as dicts."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict] = []  # type: ignore[type-arg]

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(ValueError):
            line = json.loads(record.getMessage())
            if isinstance(line, dict) and line.get("event") == "request_finished":
                self.lines.append(line)


def test_attainment_matches_the_load_generators_records(slow_server: ThreadedServer) -> None:
    url = slow_server.url
    server_log = logging.getLogger("plimsoll.runtime.requests")
    lines = RequestLines()

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
            server_log.addHandler(lines)
            level = server_log.level
            server_log.setLevel(logging.INFO)
            try:
                records = await load(url, bench_config(url, 96))
                await asyncio.sleep(0.2)  # the last request's counters are written after its final chunk
            finally:
                server_log.removeHandler(lines)
                server_log.setLevel(level)
            ratio = await track_attainment(http, svc, state, await scrape(http, url), base, 1, 40.0, LOG)
        return ratio, records, bound_ms

    ratio, records, bound_ms = asyncio.run(scenario())
    # Every request of the measured run, its warm-up ones included: the server judged them all.
    assert all(r.ok and r.ttft is not None for r in records), "every measured request should have succeeded"
    server_ttfts = sorted(line["ttft_s"] for line in lines.lines)
    client_ttfts = sorted(r.ttft for r in records)
    assert len(server_ttfts) == len(client_ttfts), (len(server_ttfts), len(client_ttfts))
    server_share = sum(t * 1000 <= bound_ms for t in server_ttfts) / len(server_ttfts)
    client_share = sum(meets_slo(r, SLO(ttft_p95_ms=bound_ms)) for r in records) / len(records)
    print(f"bound {bound_ms:.0f} ms: operator {ratio}, server's log lines {server_share:.3f}, "
          f"client's records {client_share:.3f} (a lower bound)")  # fmt: skip
    assert client_share > 0 and server_share < 1, (
        "the bound should split the requests",
        client_share,
        server_share,
    )
    # The same requests judged by the same clock (the log rounds to the microsecond).
    assert ratio is not None and abs(ratio - server_share) <= 1 / len(records) + 1e-9, (ratio, server_share)
    assert all(s <= c + 1e-5 for s, c in zip(server_ttfts, client_ttfts, strict=True))
    assert ratio >= client_share - 0.02, (ratio, client_share)
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
