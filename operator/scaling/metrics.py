"""Reading one replica's ``/metrics`` scrape into the numbers the autoscaler uses.

What it is: :func:`parse_scrape`, from Prometheus text exposition to a
:class:`PodSample` — running and waiting requests, KV-cache usage, and the TTFT
and TPOT histograms, the start-up phases, the SLO counters and the requests
its shutdown cut, the token-aware load (backlog and predicted TTFT in seconds,
prompt tokens waiting, decode tokens remaining, measured rates) and sleep state
— for either engine family in :mod:`plimsoll.metric_names`
(``plimsoll_*`` or ``vllm:*``). Parsing, histograms and ``histogram_quantile``
are :mod:`plimsoll.prometheus`'s, shared with bench and the router.

What it is not: it does not fetch anything. The handler scrapes; this reads text.
"""

from dataclasses import dataclass, field

from plimsoll.metric_names import (
    ADMISSION_REJECTIONS,
    BACKLOG_SECONDS,
    BUILD_INFO,
    DECODE_STEP_SECONDS,
    DECODE_TOKENS_REMAINING,
    ENGINE_FAMILIES,
    ENGINE_SLEEP_LEVEL,
    KV_CACHE_BYTES_PER_TOKEN,
    KV_TIER_HITS,
    PREDICTED_TTFT_SECONDS,
    PREFILL_BACKLOG_TOKENS,
    PREFILL_TOKENS_PER_SECOND,
    PROMPT_TOKENS_WAITING,
    REQUESTS_CUT_BY_SHUTDOWN,
    SLO_OBJECTIVE_SECONDS,
    SLO_REQUESTS,
    STARTUP_PHASE_SECONDS,
    detect_family,
)
from plimsoll.prometheus import ExpositionError, Histogram, Scrape, parse

# The handlers catch this name; any unreadable scrape (bad text, bad histogram) is one.
MetricsError = ExpositionError


@dataclass(frozen=True, slots=True)
class PodSample:
    """One scrape of one replica, in engine-neutral terms."""

    engine: str  # key of ENGINE_FAMILIES: "plimsoll" or "vllm"
    running: float
    waiting: float
    kv_usage: float | None  # 0..1
    ttft: Histogram | None
    tpot: Histogram | None
    # Counter of tokens generated since the engine started (live throughput for drift); None when absent.
    generation_tokens: float | None = None
    # The engine's version label (``plimsoll_build_info``); None for engines that do not export one.
    engine_version: str | None = None
    # Requests the engine finished (its success counter), to see a new replica's first answer.
    requests_finished: float | None = None
    # Start-up phase -> Unix time it ended (process start + plimsoll_startup_phase_seconds); empty for vLLM.
    startup: dict[str, float] = field(default_factory=dict)
    # Requests judged against the objectives set with PUT /slo (plimsoll_slo_requests_total), and
    # those objectives (objective -> seconds); None / empty where the engine does not judge.
    slo_good: float | None = None
    slo_bad: float | None = None
    slo_objectives: dict[str, float] = field(default_factory=dict)
    # Requests the replica's own shutdown ended (plimsoll_requests_cut_by_shutdown_total); None for vLLM.
    requests_cut: float | None = None
    # Requests refused before reaching the engine, by reason (plimsoll_admission_rejections_total,
    # cumulative); empty for engines that do not export it.
    refused: dict[str, float] = field(default_factory=dict)
    # Prefix cache (tokens, cumulative): looked up, found in the replica's own cache, found per KV tier.
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    tier_hits: dict[str, float] = field(default_factory=dict)
    # Prompt tokens admitted and not yet computed (plimsoll_prefill_backlog_tokens): a prefill pool's
    # signal; None for engines that do not export it.
    prefill_backlog_tokens: float | None = None
    kv_bytes_per_token: float | None = None  # plimsoll_kv_cache_bytes_per_token
    # Token-aware load (plimsoll.ttft_prediction), None where the engine does not export it (vLLM, an
    # older plimsoll, a replica that has not measured its rates yet).
    prompt_tokens_waiting: float | None = None
    decode_tokens_remaining: float | None = None
    backlog_s: float | None = None  # a request arriving now waits this long before its prefill starts
    predicted_ttft_s: float | None = None  # for a request of the replica's recent mean prompt length
    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    sleep_level: int = 0  # sleep mode: 0 awake, 1 or 2 asleep
    resident_bytes: float | None = None  # process_resident_memory_bytes: what a parked replica holds

    @property
    def in_flight(self) -> float:
        """Requests the replica holds: running plus waiting (the autoscaler's per-pod metric)."""
        return self.running + self.waiting


# Every series parse_scrape reads, in either family; the rest of a replica's exposition is skipped unparsed.
READ = frozenset(
    {
        name
        for f in ENGINE_FAMILIES.values()
        for name in (
            f.running,
            f.waiting,
            f.kv_usage,
            f.ttft,
            f.tpot,
            f.generation_tokens,
            f.request_success,
            f.prefix_queries,
            f.prefix_hits,
        )
    }
    | {
        BUILD_INFO,
        KV_TIER_HITS,
        STARTUP_PHASE_SECONDS,
        "process_start_time_seconds",
        SLO_REQUESTS,
        SLO_OBJECTIVE_SECONDS,
        REQUESTS_CUT_BY_SHUTDOWN,
        ADMISSION_REJECTIONS,
        PREFILL_BACKLOG_TOKENS,
        KV_CACHE_BYTES_PER_TOKEN,
        PROMPT_TOKENS_WAITING,
        DECODE_TOKENS_REMAINING,
        BACKLOG_SECONDS,
        PREDICTED_TTFT_SECONDS,
        PREFILL_TOKENS_PER_SECOND,
        DECODE_STEP_SECONDS,
        ENGINE_SLEEP_LEVEL,
        "process_resident_memory_bytes",
    }
)


def parse_scrape(text: str) -> PodSample:
    """Read a replica's exposition text; raise :class:`MetricsError` when it is not engine metrics."""
    scrape = parse(text, only=READ)
    engine = detect_family(scrape.names())
    if engine is None:
        expected = ", ".join(f"{f.running} ({key})" for key, f in ENGINE_FAMILIES.items())
        raise MetricsError(
            f"no engine gauges in the scrape (looked for {expected}); is the pod running plimsoll or vLLM "
            "and serving /metrics on this port?"
        )
    engine_key = next(key for key, f in ENGINE_FAMILIES.items() if f is engine)
    # One series per model or engine label set; the pod holds them all.
    running = scrape.sum(engine.running)
    waiting = scrape.sum(engine.waiting)
    if running is None or waiting is None:
        missing = engine.running if running is None else engine.waiting
        raise MetricsError(
            f"the scrape has no {missing} gauge; the autoscaler needs both running and waiting"
        )
    kv_values = scrape.values(engine.kv_usage)
    return PodSample(
        engine=engine_key,
        running=running,
        waiting=waiting,
        # Several engines behind one pod (data parallel) report one ratio each; the fullest one limits.
        kv_usage=max(kv_values) if kv_values else None,
        ttft=scrape.histogram(engine.ttft),
        tpot=scrape.histogram(engine.tpot),
        generation_tokens=scrape.sum(engine.generation_tokens),
        engine_version=_engine_version(scrape),
        requests_finished=scrape.sum(engine.request_success),
        startup=_startup(scrape),
        slo_good=_labelled_sum(scrape, SLO_REQUESTS, "result", "good"),
        slo_bad=_labelled_sum(scrape, SLO_REQUESTS, "result", "bad"),
        slo_objectives={
            labels["objective"]: value
            for labels, value in scrape.samples.get(SLO_OBJECTIVE_SECONDS, [])
            if "objective" in labels
        },
        requests_cut=scrape.sum(REQUESTS_CUT_BY_SHUTDOWN),
        refused=_by_label(scrape, ADMISSION_REJECTIONS, "reason"),
        prefix_queries=scrape.sum(engine.prefix_queries),
        prefix_hits=scrape.sum(engine.prefix_hits),
        tier_hits=_tier_hits(scrape),
        prefill_backlog_tokens=scrape.sum(PREFILL_BACKLOG_TOKENS),
        kv_bytes_per_token=scrape.sum(KV_CACHE_BYTES_PER_TOKEN),
        prompt_tokens_waiting=scrape.sum(PROMPT_TOKENS_WAITING),
        decode_tokens_remaining=scrape.sum(DECODE_TOKENS_REMAINING),
        backlog_s=_max(scrape, BACKLOG_SECONDS),
        predicted_ttft_s=_max(scrape, PREDICTED_TTFT_SECONDS),
        prefill_tokens_per_s=_max(scrape, PREFILL_TOKENS_PER_SECOND),
        decode_step_s=_max(scrape, DECODE_STEP_SECONDS),
        sleep_level=int(_max(scrape, ENGINE_SLEEP_LEVEL) or 0),
        resident_bytes=scrape.sum("process_resident_memory_bytes"),
    )


def _max(scrape: Scrape, name: str) -> float | None:
    # One series per engine behind the pod: the slowest one decides what a request may wait.
    values = scrape.values(name)
    return max(values) if values else None


def _tier_hits(scrape: Scrape) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in scrape.samples.get(KV_TIER_HITS, []):
        medium = labels.get("medium", "")
        out[medium] = out.get(medium, 0.0) + value
    return out


def _by_label(scrape: Scrape, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in scrape.samples.get(name, []):
        if label in labels:
            out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


def _labelled_sum(scrape: Scrape, name: str, label: str, value: str) -> float | None:
    rows = [v for labels, v in scrape.samples.get(name, []) if labels.get(label) == value]
    return sum(rows) if rows else None


def _startup(scrape: Scrape) -> dict[str, float]:
    started = scrape.values("process_start_time_seconds")
    if not started:
        return {}
    return {
        labels["phase"]: started[0] + value
        for labels, value in scrape.samples.get(STARTUP_PHASE_SECONDS, [])
        if "phase" in labels
    }


def _engine_version(scrape: Scrape) -> str | None:
    # An Info metric is exposed as <name>_info{version="..."} 1; several engines in a pod share one.
    versions = sorted(
        {labels["version"] for labels, _ in scrape.samples.get(BUILD_INFO, []) if "version" in labels}
    )
    return ",".join(versions) or None


__all__ = ["MetricsError", "PodSample", "parse_scrape"]
