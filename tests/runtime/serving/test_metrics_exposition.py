"""/metrics: every plimsoll_* series, vLLM's buckets, and counters that match the traffic sent."""

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import chat_model_dir, metric, scrape, start_server  # noqa: F401  (fixture)

from plimsoll import metric_names as mn
from plimsoll.runtime.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepStats
from plimsoll.runtime.serving.metrics import ServerMetrics
from plimsoll.runtime.testing import ThreadedServer

ALL_NAMES = [
    v for k, v in vars(mn).items() if k.isupper() and isinstance(v, str) and v.startswith("plimsoll_")
]
ALLOWED_LABELS = {
    "model_name",
    "path",  # plimsoll_engine_steps_total: what ran a step, one of four
    "finished_reason",
    "reason",
    "le",
    "block_size",
    "num_gpu_blocks",
    "enable_prefix_caching",
    "cache_dtype",
    "gpu_memory_utilization",  # cache_config_info: the configured share ("" for an explicit size)
    "kv_cache_memory_bytes",  # cache_config_info: the KV cache's bytes
    "priority",  # the request's integer class, clamped to -16..16 (never a tenant id)
    "position",  # spec_decode accepted tokens per draft position (0..k-1)
    "version",  # plimsoll_build_info: the engine's version
    "phase",  # plimsoll_startup_phase_seconds: one of five start-up phases
    "result",  # plimsoll_slo_requests_total: good or bad
    "objective",  # plimsoll_slo_objective_seconds: ttft, tpot or e2e
    "medium",  # plimsoll_kv_tier_*, plimsoll_kv_offload_*: CPU, DISK or SHARED
    "side",  # plimsoll_kv_transfer_cpu_seconds: producer or consumer
    "stage",  # plimsoll_kv_transfer_cpu_seconds: one of five (remote_prefill.CPU_STAGES)
    "thread",  # plimsoll_kv_transfer_cpu_seconds: engine or transfer
    "cause",  # plimsoll_admitted_ttft_missed_total: stall or queue
}
# prometheus_client's standard collectors (process_*, python_gc_*, python_info) carry
# their own fixed labels; they are not plimsoll series and are checked apart.
STANDARD_COLLECTOR_LABELS = {"generation", "implementation", "major", "minor", "patchlevel", "version"}


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _family_name(name: str) -> str:
    return name.removesuffix("_total")  # the parser names counter families without _total


def test_every_shared_metric_name_is_exported_with_vllm_buckets() -> None:
    m = ServerMetrics("tiny")
    body, content_type = m.exposition()
    assert content_type.startswith("text/plain")
    fams = families(body.decode())
    for name in ALL_NAMES:
        if name == mn.PREFIX:
            continue
        assert _family_name(name) in fams, f"{name} missing from /metrics"
    # Counters have a zero sample from the first scrape, so rate() and dashboards see them at once.
    first = _samples(m)
    for counter in (
        mn.NUM_PREEMPTIONS,
        mn.KV_CACHE_ALLOCATION_FAILURES,
        mn.PREFIX_CACHE_QUERIES,
        mn.PREFIX_CACHE_HITS,
    ):
        assert first[counter.removesuffix("_total") + "_total{}"] == 0.0, counter
    m.start_counting()
    m.on_request_finished(_finished(arrival=0.0, sched=0.5, first=0.6, last=1.6, done=1.7, prompt=5, gen=11))
    s = _samples(m)
    ttft_buckets = sorted(
        float(k.split("le=")[1].rstrip("}").split(",")[0])
        for k in s
        if k.startswith(mn.TIME_TO_FIRST_TOKEN + "_bucket") and "+Inf" not in k
    )
    assert tuple(ttft_buckets) == mn.TTFT_BUCKETS


def _finished(
    *,
    arrival: float,
    sched: float,
    first: float,
    last: float,
    done: float,
    prompt: int,
    gen: int,
    reason: str = "length",
) -> RequestOutput:
    rm = RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=sched,
        first_token_time=first,
        last_token_time=last,
        finished_time=done,
        num_prompt_tokens=prompt,
        num_generation_tokens=gen,
        finish_reason=reason,
    )
    out = CompletionOutput(index=0, text="x" * gen, token_ids=list(range(gen)), finish_reason=reason)
    return RequestOutput("r", list(range(prompt)), [out], True, rm)


def _samples(m: ServerMetrics) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(m.exposition()[0].decode()):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_request_intervals_follow_vllm_definitions() -> None:
    m = ServerMetrics("tiny")
    m.on_request_finished(_finished(arrival=0, sched=1, first=2, last=3, done=3, prompt=1, gen=2))
    assert metric(_samples(m), mn.E2E_REQUEST_LATENCY + "_count") == 0  # warm-up is not counted
    m.start_counting()
    m.on_request_finished(_finished(arrival=0.0, sched=0.5, first=0.6, last=1.6, done=1.7, prompt=5, gen=11))
    m.on_step(
        StepStats(
            num_running=3,
            num_waiting=2,
            batch_size=3,
            num_scheduled_tokens=40,
            num_prefill_tokens=38,
            num_decode_tokens=2,
            num_preemptions=1,
            num_kv_allocation_failures=2,
            prefix_cache_queries=32,
            prefix_cache_hits=16,
            kv_cache_usage=0.25,
            step_time_s=0.01,
        )
    )
    s = _samples(m)
    assert metric(s, mn.REQUEST_QUEUE_TIME + "_sum") == pytest.approx(0.5)
    assert metric(s, mn.REQUEST_PREFILL_TIME + "_sum") == pytest.approx(0.1)
    assert metric(s, mn.TIME_TO_FIRST_TOKEN + "_sum") == pytest.approx(0.6)
    assert metric(s, mn.REQUEST_DECODE_TIME + "_sum") == pytest.approx(1.0)
    assert metric(s, mn.TIME_PER_OUTPUT_TOKEN + "_sum") == pytest.approx(0.1)  # 1.0 s / (11 - 1)
    assert metric(s, mn.E2E_REQUEST_LATENCY + "_sum") == pytest.approx(1.7)
    assert metric(s, mn.PROMPT_TOKENS) == 5 and metric(s, mn.GENERATION_TOKENS) == 11
    assert metric(s, mn.REQUEST_SUCCESS, finished_reason="length") == 1
    assert metric(s, mn.NUM_REQUESTS_RUNNING) == 3 and metric(s, mn.NUM_REQUESTS_WAITING) == 2
    assert metric(s, mn.KV_CACHE_USAGE_RATIO) == 0.25
    assert metric(s, mn.NUM_PREEMPTIONS) == 1 and metric(s, mn.KV_CACHE_ALLOCATION_FAILURES) == 2
    assert metric(s, mn.PREFIX_CACHE_QUERIES) == 32 and metric(s, mn.PREFIX_CACHE_HITS) == 16
    assert metric(s, mn.BATCH_SIZE + "_sum") == 3 and metric(s, mn.STEP_TOKENS + "_sum") == 40


@pytest.fixture(scope="module")
def fresh_server(chat_model_dir: Path) -> Iterator[ThreadedServer]:  # noqa: F811
    srv = start_server(chat_model_dir, server={"max_waiting": 1000})
    yield srv
    srv.stop()


def test_counters_match_the_traffic_sent(fresh_server: ThreadedServer) -> None:
    url = fresh_server.url
    before = scrape(url)
    prompt_tokens = completion_tokens = 0
    shared = "a shared prefix of exactly forty bytes."  # 2 full 16-token blocks + a partial one
    with httpx.Client(base_url=url, timeout=60) as http:
        for i in range(4):
            body = {"prompt": shared if i < 2 else f"prompt {i}", "max_tokens": 3 + i, "ignore_eos": True}
            usage = http.post("/v1/completions", json=body).json()["usage"]
            prompt_tokens += usage["prompt_tokens"]
            completion_tokens += usage["completion_tokens"]
        chat = {
            "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 4,
            "n": 2,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        lines = [ln for ln in http.post("/v1/chat/completions", json=chat).text.split("\n\n") if ln]
        usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
        prompt_tokens += usage["prompt_tokens"]
        completion_tokens += usage["completion_tokens"]
        assert http.post("/v1/completions", json={"prompt": "x", "model": "nope"}).status_code == 404
        r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta(mn.PROMPT_TOKENS) == prompt_tokens
    assert delta(mn.GENERATION_TOKENS) == completion_tokens == 3 + 4 + 5 + 6 + 2 * 4
    assert delta(mn.REQUEST_SUCCESS, finished_reason="length") == 5
    assert delta(mn.REQUEST_SUCCESS, finished_reason="stop") == 0
    for hist in (
        mn.TIME_TO_FIRST_TOKEN,
        mn.E2E_REQUEST_LATENCY,
        mn.REQUEST_QUEUE_TIME,
        mn.REQUEST_PREFILL_TIME,
        mn.REQUEST_DECODE_TIME,
        mn.TIME_PER_OUTPUT_TOKEN,
    ):
        assert delta(hist + "_count") == 5, hist
    assert delta(mn.INTER_TOKEN_LATENCY + "_count") >= 1
    # The second identical 40-token prompt finds its two full blocks in the prefix cache.
    assert delta(mn.PREFIX_CACHE_HITS) >= 32
    assert delta(mn.PREFIX_CACHE_QUERIES) >= prompt_tokens - 1
    assert delta(mn.BATCH_SIZE + "_count") >= 1
    assert delta(mn.STEP_TOKENS + "_sum") >= completion_tokens
    stats = fresh_server.engine.stats()
    info = {k: v for k, v in after.items() if k.startswith(mn.CACHE_CONFIG_INFO)}
    assert list(info.values()) == [1.0]
    assert f"num_gpu_blocks={stats.num_blocks}" in next(iter(info)) and "block_size=16" in next(iter(info))
    # Low cardinality: only the fixed label names, and model_name is the served name.
    text = httpx.get(f"{url}/metrics").text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            allowed = ALLOWED_LABELS if s.name.startswith("plimsoll") else STANDARD_COLLECTOR_LABELS
            assert set(s.labels) <= allowed, (s.name, s.labels)
            if "model_name" in s.labels:
                assert s.labels["model_name"] == fresh_server.engine.model_name
