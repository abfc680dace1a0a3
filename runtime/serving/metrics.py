"""Prometheus metrics of one replica: the ``plimsoll_*`` series and what feeds them.

What it is: :class:`ServerMetrics` owns a private ``CollectorRegistry`` with every
series named in :mod:`plimsoll.metric_names` (names, meanings and histogram
buckets mirror vLLM 0.32's; see docs/metrics.md). It is the engine's observer
(``on_step`` after every step, ``on_request_finished`` per request, both called
from the engine thread; prometheus_client is thread-safe) and the server feeds it
what only the server sees: inter-token gaps as streamed, admission rejections,
and a fresh gauge reading at scrape time.

What it is not: an HTTP handler (server.py serves ``/metrics``) or a place for
high-cardinality labels: the only labels are ``model_name`` and small fixed sets
(``finished_reason``, ``reason``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from plimsoll import __version__
from plimsoll import metric_names as mn
from plimsoll.runtime.engine.startup import STARTUP
from plimsoll.runtime.models.cpu_plan import STEP_PATHS

# vLLM's cache_config_info labels (CacheConfig fields); gpu_memory_utilization is "" when the
# cache size was given in bytes.
CACHE_CONFIG_LABELS = (
    "block_size",
    "num_gpu_blocks",
    "enable_prefix_caching",
    "cache_dtype",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
)

FINISHED_REASONS = ("stop", "length", "abort", "error")
REJECTION_REASONS = (
    "queue_full",
    "draining",
    "invalid_request",
    "timeout",
    "tenant_limit",
    "slo_ttft",
    "asleep",
)
# Why a request admitted under a TTFT bound missed it (plimsoll.ttft_prediction.classify_miss).
MISS_CAUSES = ("stall", "queue")
# Why an admitted request failed server-side: its own fault in the engine, or the engine dead.
ERROR_REASONS = ("engine_error", "engine_dead")


class _StepStats(Protocol):
    num_running: int
    num_waiting: int
    batch_size: int
    num_scheduled_tokens: int
    num_preemptions: int
    num_kv_allocation_failures: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_cache_usage: float


class _EngineStats(Protocol):
    num_running: int
    num_waiting: int
    kv_cache_usage: float


SLO_OBJECTIVES = ("ttft", "tpot", "e2e")


def _meets(
    slo: dict[str, float], reason: str, rm: Any, arrival: float,
    first: float | None, last: float | None, done: float | None,
) -> bool:  # fmt: skip
    """Succeeded, and every bound set holds (a percentile objective applied per request, as bench does)."""
    if reason not in ("stop", "length") or first is None:
        return False
    ttft = first - arrival
    tpot = (
        (last - first) / (rm.num_generation_tokens - 1)
        if last is not None and rm.num_generation_tokens > 1
        else 0.0
    )
    e2e = (done if done is not None else last or first) - arrival
    limits = {"ttft": ttft, "tpot": tpot, "e2e": e2e}
    return all(limits[k] <= bound for k, bound in slo.items())


def _strip_total(name: str) -> str:
    # prometheus_client appends _total to counters itself.
    return name.removesuffix("_total")


class ServerMetrics:
    """Every ``plimsoll_*`` series for one served model, in its own registry."""

    def __init__(
        self, model_name: str, registry: CollectorRegistry | None = None, metrics_compat: str | None = None
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        # The default registry's process_* (resident memory, CPU, fds), python_gc_* and
        # python_info series: `bench soak` and dashboards watch memory growth through them.
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            # A caller's registry (e.g. the default one) may hold them already.
            with contextlib.suppress(ValueError):
                r.register(collector)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, [*labels, *extra], registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(_strip_total(name), doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, [*labels, *extra], buckets=buckets, registry=r)

        self.running = gauge(
            mn.NUM_REQUESTS_RUNNING, "Requests in the running batch (vllm:num_requests_running)."
        )
        self.waiting = gauge(
            mn.NUM_REQUESTS_WAITING, "Requests waiting to be scheduled (vllm:num_requests_waiting)."
        )
        self.kv_usage = gauge(
            mn.KV_CACHE_USAGE_RATIO, "Fraction of KV-cache blocks in use, 0..1 (vllm:kv_cache_usage_perc)."
        )
        self.kv_bytes_per_token = gauge(
            mn.KV_CACHE_BYTES_PER_TOKEN, "Bytes of KV cache one token takes (all layers, K and V, this rank)."
        )
        self.kv_resident = gauge(
            mn.KV_CACHE_RESIDENT_BYTES,
            "Bytes of the KV cache in memory now (CPU: its resident pages, counted with mincore; an "
            "accelerator: its allocation). About 0 while asleep (sleep mode).",
        )
        self.prefill_backlog = gauge(
            mn.PREFILL_BACKLOG_TOKENS,
            "Prompt tokens admitted but not yet computed, over waiting and running requests (what prefill "
            "still has to do; a prefill pool scales on it).",
        )
        self.http_connections = gauge(
            mn.HTTP_CONNECTIONS, "Open HTTP connections to this server (what a soak watches for leaks)."
        )
        self.cache_config = gauge(
            mn.CACHE_CONFIG_INFO,
            "KV-cache configuration; value 1 (vllm:cache_config_info).",
            CACHE_CONFIG_LABELS,
        )
        # prometheus_client appends _info: plimsoll_build_info{version} 1 (the operator's drift check reads it).
        Info(
            mn.BUILD_INFO.removesuffix("_info"), "Version of the running engine.", labels, registry=r
        ).labels(model_name).info({"version": __version__})
        self.startup_phase = gauge(
            mn.STARTUP_PHASE_SECONDS,
            "Seconds from process start to the end of each start-up phase "
            "(imports, weights_loaded, kv_cache_allocated, warmup_done, ready).",
            ("phase",),
        )
        self.ttft = histogram(mn.TIME_TO_FIRST_TOKEN, "Arrival to first token, seconds.", mn.TTFT_BUCKETS)
        self.itl = histogram(
            mn.INTER_TOKEN_LATENCY,
            "Gap between successive token emissions, seconds.",
            mn.TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            mn.TIME_PER_OUTPUT_TOKEN,
            "Per request: decode time / (generated tokens - 1), seconds.",
            mn.TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            mn.E2E_REQUEST_LATENCY, "Arrival to finish, seconds.", mn.REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            mn.REQUEST_QUEUE_TIME, "Arrival to first scheduled, seconds.", mn.REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            mn.REQUEST_PREFILL_TIME, "First scheduled to first token, seconds.", mn.REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            mn.REQUEST_DECODE_TIME, "First token to last token, seconds.", mn.REQUEST_LATENCY_BUCKETS
        )
        self.prefix_queries = counter(mn.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter(mn.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.")
        self.preemptions = counter(
            mn.NUM_PREEMPTIONS, "Requests preempted (KV blocks freed, recomputed later)."
        )
        self.prompt_tokens = counter(mn.PROMPT_TOKENS, "Prompt tokens of finished requests.")
        self.generation_tokens = counter(mn.GENERATION_TOKENS, "Generated tokens of finished requests.")
        self.request_success = counter(
            mn.REQUEST_SUCCESS, "Finished requests by finish reason.", ("finished_reason",)
        )
        self.kv_alloc_failures = counter(
            mn.KV_CACHE_ALLOCATION_FAILURES, "Times the scheduler could not get KV blocks for a request."
        )
        self.engine_steps = counter(
            mn.ENGINE_STEPS,
            "Engine steps that ran the model, by what ran it: fused_decode, glued_layers, module_layers "
            "or cuda_graph.",
            ("path",),
        )
        self.batch_size = histogram(
            mn.BATCH_SIZE, "Sequences per engine step.", tuple(float(b) for b in mn.BATCH_SIZE_BUCKETS)
        )
        self.step_tokens = histogram(
            mn.STEP_TOKENS,
            "Tokens scheduled per engine step.",
            tuple(float(b) for b in mn.STEP_TOKENS_BUCKETS),
        )
        # One series per priority class; classes are the request's integer, clamped so a
        # client cannot mint unbounded label values.
        self.priority_ttft = histogram(
            mn.PRIORITY_TIME_TO_FIRST_TOKEN,
            "Arrival to first token by priority class, seconds.",
            mn.TTFT_BUCKETS,
            ("priority",),
        )
        self.priority_queue_time = histogram(
            mn.PRIORITY_REQUEST_QUEUE_TIME,
            "Arrival to first scheduled by priority class, seconds.",
            mn.REQUEST_LATENCY_BUCKETS,
            ("priority",),
        )
        self.priority_requests = counter(
            mn.PRIORITY_REQUESTS, "Finished requests by priority class.", ("priority",)
        )
        self.rejections = counter(
            mn.ADMISSION_REJECTIONS, "Requests refused before reaching the engine, by reason.", ("reason",)
        )
        self.admitted_misses = counter(
            mn.ADMITTED_TTFT_MISSES,
            "Requests admitted under a TTFT bound that missed it, by cause (stall: a step slower than "
            "the promise allowed; queue: none).",
            ("cause",),
        )
        # --metrics-compat vllm: the same readings also under the vLLM names a Gateway API
        # Inference Extension endpoint picker reads (model-server protocol); see docs/metrics.md.
        self.compat: tuple[Gauge, Gauge, Gauge, Gauge] | None = None
        if metrics_compat == "vllm":
            self.compat = (
                gauge(
                    "vllm:num_requests_running",
                    "Requests in the running batch (= plimsoll_num_requests_running).",
                ),
                gauge(
                    "vllm:num_requests_waiting",
                    "Requests waiting to be scheduled (= plimsoll_num_requests_waiting).",
                ),
                gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1 (= plimsoll_kv_cache_usage_ratio)."),
                gauge(
                    "vllm:cache_config_info",
                    "KV-cache configuration; value 1 (= plimsoll_cache_config_info).",
                    CACHE_CONFIG_LABELS,
                ),
            )
        elif metrics_compat is not None:
            raise ValueError(f"--metrics-compat {metrics_compat!r}: the only compatible family is vllm")
        # The KV tiers' series (runtime/kv/), read from the engine's connector once it runs.
        self.attach_kv_tiers(None)
        # --enable-lora (GIE's model-server protocol): one series, value = when it was set, labels =
        # the adapters of running and waiting requests (comma-joined) and the slot count.
        lora_info_labels = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")
        self.lora_info = [gauge(mn.LORA_REQUESTS_INFO, "LoRA adapters in use; value = unix time.", lora_info_labels)]
        if metrics_compat == "vllm":
            self.lora_info.append(
                gauge(mn.VLLM_LORA_REQUESTS_INFO, "LoRA adapters in use (= plimsoll_lora_requests_info).",
                      lora_info_labels)
            )
        self.lora_requests = counter(mn.LORA_REQUESTS, "Finished requests by LoRA adapter.", ("lora_name",))
        self.lora_swaps = counter(
            mn.LORA_SWAPS, "LoRA adapters copied into a --max-loras device slot (first loads and swaps)."
        )
        self.cut_by_shutdown = counter(
            mn.REQUESTS_CUT_BY_SHUTDOWN,
            "Requests still in flight when the drain deadline after SIGTERM passed, ended by the shutdown.",
        )
        self.spec_drafts = counter(
            mn.SPEC_DECODE_NUM_DRAFTS, "Sequences that carried proposals into a step (speculative decoding)."
        )
        self.spec_draft_tokens = counter(mn.SPEC_DECODE_NUM_DRAFT_TOKENS, "Proposed tokens verified.")
        self.spec_accepted_tokens = counter(mn.SPEC_DECODE_NUM_ACCEPTED_TOKENS, "Proposed tokens accepted.")
        self.spec_accepted_per_pos = counter(
            mn.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
            "Accepted proposals by position (0-based).",
            ("position",),
        )
        self.request_errors = counter(
            mn.REQUEST_ERRORS, "Admitted requests that failed with a server error, by reason.", ("reason",)
        )
        self.slo_requests = counter(
            mn.SLO_REQUESTS,
            "Finished requests judged against the objectives set with PUT /slo: good when it succeeded "
            "and its TTFT, TPOT and end-to-end latency are each within the bound set.",
            ("result",),
        )
        self.slo_objective = gauge(
            mn.SLO_OBJECTIVE_SECONDS, "Per-request bounds in force (PUT /slo), seconds.", ("objective",)
        )
        # Token-aware load (plimsoll.ttft_prediction): the queue, the measured rates, the prediction.
        self.prompt_tokens_waiting = gauge(
            mn.PROMPT_TOKENS_WAITING,
            "Prompt tokens not yet prefilled (waiting requests and unfinished prefills).",
        )
        self.decode_tokens_remaining = gauge(
            mn.DECODE_TOKENS_REMAINING, "Tokens the running sequences may still generate (max_tokens left)."
        )
        self.prefill_rate = gauge(
            mn.PREFILL_TOKENS_PER_SECOND, "Measured prefill rate, prompt tokens per second."
        )
        self.decode_step = gauge(mn.DECODE_STEP_SECONDS, "Measured decode step time, seconds.")
        self.backlog = gauge(
            mn.BACKLOG_SECONDS,
            "Seconds a request arriving now would wait before its prefill starts (predicted).",
        )
        self.predicted_ttft = gauge(
            mn.PREDICTED_TTFT_SECONDS,
            "TTFT predicted for a request of the recent mean prompt length arriving now, seconds.",
        )
        self.sleep_level = gauge(mn.ENGINE_SLEEP_LEVEL, "0 awake; 1 or 2: asleep at that level (sleep mode).")
        self.mean_prompt_tokens = 0.0  # EWMA over finished requests: the prompt the prediction is for
        # objective ("ttft", "tpot", "e2e") -> seconds; empty: nothing is judged.
        self.slo: dict[str, float] = {}
        # The engine's warm-up request is not client traffic; the server switches
        # counting on once the engine is ready (see start_counting).
        self.counting = False
        # Pre-initialise label sets so rates exist from the first scrape (as vLLM does).
        for reason in FINISHED_REASONS:
            self.request_success.labels(model_name, reason)
        for reason in REJECTION_REASONS:
            self.rejections.labels(model_name, reason)
        for reason in ERROR_REASONS:
            self.request_errors.labels(model_name, reason)
        for cause in MISS_CAUSES:
            self.admitted_misses.labels(model_name, cause)
        for path in STEP_PATHS:
            self.engine_steps.labels(model_name, path)
        for family in (self.preemptions, self.kv_alloc_failures, self.prefix_queries, self.prefix_hits,
                       self.cut_by_shutdown, self.lora_swaps):
            family.labels(model_name)

    # ---- the engine observer ---------------------------------------------------

    def set_slo(self, bounds: dict[str, float | None]) -> None:
        """The per-request bounds to judge finished requests by (seconds); None removes one."""
        self.slo = {k: v for k, v in bounds.items() if v is not None}
        for objective in SLO_OBJECTIVES:
            if objective in self.slo:
                self.slo_objective.labels(self.model_name, objective).set(self.slo[objective])
            else:
                with contextlib.suppress(KeyError):
                    self.slo_objective.remove(self.model_name, objective)
        for result in ("good", "bad"):
            self.slo_requests.labels(self.model_name, result)

    def start_counting(self) -> None:
        self.counting = True

    def on_step(self, stats: _StepStats) -> None:
        if not self.counting:
            return
        self._set_gauges(stats)
        m = self.model_name
        path = getattr(stats, "step_path", "")
        if path:
            self.engine_steps.labels(m, path).inc()
        if stats.batch_size > 0:
            self.batch_size.labels(m).observe(stats.batch_size)
            self.step_tokens.labels(m).observe(stats.num_scheduled_tokens)
        if stats.num_preemptions:
            self.preemptions.labels(m).inc(stats.num_preemptions)
        if stats.num_kv_allocation_failures:
            self.kv_alloc_failures.labels(m).inc(stats.num_kv_allocation_failures)
        if stats.prefix_cache_queries:
            self.prefix_queries.labels(m).inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            self.prefix_hits.labels(m).inc(stats.prefix_cache_hits)
        if getattr(stats, "spec_num_drafts", 0):
            self._on_spec_step(stats)
        swaps = getattr(stats, "lora_swaps", 0)
        if swaps:
            self.lora_swaps.labels(m).inc(swaps)

    def _on_spec_step(self, stats: Any) -> None:
        m = self.model_name
        self.spec_drafts.labels(m).inc(stats.spec_num_drafts)
        self.spec_draft_tokens.labels(m).inc(stats.spec_num_draft_tokens)
        self.spec_accepted_tokens.labels(m).inc(stats.spec_num_accepted_tokens)
        for pos, count in enumerate(stats.spec_num_accepted_tokens_per_pos):
            self.spec_accepted_per_pos.labels(m, str(pos)).inc(count)

    def on_request_finished(self, output: Any) -> None:
        """Request-level histograms and counters from the engine's timestamps.

        Intervals follow vLLM's definitions: queue = arrival to first scheduled,
        prefill = first scheduled to first token, decode = first to last token,
        TPOT = decode / (generated - 1). A stamp the request never reached (an
        abort while waiting) leaves its intervals unobserved.
        """
        if not self.counting:
            return
        rm = output.metrics
        m = self.model_name
        reason = rm.finish_reason or _finish_reason(output) or "abort"
        self.request_success.labels(m, reason if reason in FINISHED_REASONS else "error").inc()
        cls = priority_label(rm.priority)
        self.priority_requests.labels(m, cls).inc()
        if rm.num_prompt_tokens:
            mean = self.mean_prompt_tokens
            self.mean_prompt_tokens = (
                rm.num_prompt_tokens if not mean else mean + 0.1 * (rm.num_prompt_tokens - mean)
            )
        self.prompt_tokens.labels(m).inc(rm.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(rm.num_generation_tokens)
        if getattr(rm, "lora_name", None) is not None:
            self.lora_requests.labels(m, rm.lora_name).inc()
        arrival, sched = rm.arrival_time, rm.first_scheduled_time
        first, last, done = rm.first_token_time, rm.last_token_time, rm.finished_time
        slo = self.slo
        if slo:
            self.slo_requests.labels(
                m, "good" if _meets(slo, reason, rm, arrival, first, last, done) else "bad"
            ).inc()
        if done is not None:
            self.e2e.labels(m).observe(max(0.0, done - arrival))
        if sched is not None:
            self.queue_time.labels(m).observe(max(0.0, sched - arrival))
            self.priority_queue_time.labels(m, cls).observe(max(0.0, sched - arrival))
        if first is not None:
            self.ttft.labels(m).observe(max(0.0, first - arrival))
            self.priority_ttft.labels(m, cls).observe(max(0.0, first - arrival))
            if sched is not None:
                self.prefill_time.labels(m).observe(max(0.0, first - sched))
            if last is not None:
                decode = max(0.0, last - first)
                self.decode_time.labels(m).observe(decode)
                if rm.num_generation_tokens > 1:
                    self.tpot.labels(m).observe(decode / (rm.num_generation_tokens - 1))

    # ---- what the server feeds -------------------------------------------------

    def observe_token_gap(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def reject(self, reason: str) -> None:
        assert reason in REJECTION_REASONS, reason
        self.rejections.labels(self.model_name, reason).inc()

    def admitted_miss(self, cause: str) -> None:
        assert cause in MISS_CAUSES, cause
        self.admitted_misses.labels(self.model_name, cause).inc()

    def judge_shed(self) -> None:
        """A request refused because it would miss its SLO counts against the SLO (when one is set)."""
        if self.slo:
            self.slo_requests.labels(self.model_name, "bad").inc()

    def refresh_load(self, queue: Any, rates: Any, sleep_level: int = 0) -> None:
        """The token-aware gauges from the engine's queue snapshot and measured rates (None: not yet)."""
        from plimsoll.ttft_prediction import predict_ttft

        m = self.model_name
        self.sleep_level.labels(m).set(sleep_level)
        self.prompt_tokens_waiting.labels(m).set(queue.waiting_prompt_tokens)
        self.decode_tokens_remaining.labels(m).set(queue.decode_tokens_remaining)
        if rates is None:
            return
        self.prefill_rate.labels(m).set(rates.prefill_tokens_per_s)
        self.decode_step.labels(m).set(rates.decode_step_s)
        prediction = predict_ttft(queue, rates, round(self.mean_prompt_tokens))
        self.backlog.labels(m).set(prediction.backlog_s)
        self.predicted_ttft.labels(m).set(prediction.ttft_s)

    def cut_by_shutdown_add(self, count: int) -> None:
        """Count requests the shutdown ends because the drain deadline passed (the operator reads it)."""
        self.cut_by_shutdown.labels(self.model_name).inc(count)

    def request_error(self, reason: str) -> None:
        assert reason in ERROR_REASONS, reason
        self.request_errors.labels(self.model_name, reason).inc()

    def attach_kv_tiers(self, connector: Any) -> None:
        """Read the KV tiers' series (runtime/kv/) from the engine's connector from now on."""
        if getattr(self, "_kv_tiers", None) is None:
            from plimsoll.runtime.serving.kv_metrics import KVTierCollector

            self._kv_tiers = KVTierCollector(None, self.model_name)
            self.registry.register(self._kv_tiers)
        if connector is not None:
            self._kv_tiers.connector = connector

    def set_cache_config(
        self,
        *,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool,
        cache_dtype: str,
        gpu_memory_utilization: float | None = None,
        kv_cache_memory_bytes: int = 0,
    ) -> None:
        labels = (
            self.model_name,
            str(block_size),
            str(num_blocks),
            str(enable_prefix_caching),
            cache_dtype,
            "" if gpu_memory_utilization is None else f"{gpu_memory_utilization:g}",  # "": an explicit size
            str(kv_cache_memory_bytes),
        )
        self.cache_config.labels(*labels).set(1)
        if self.compat is not None:
            self.compat[3].labels(*labels).set(1)

    def refresh(self, stats: _EngineStats) -> None:
        """Read the gauges fresh from the engine: an abort frees blocks between steps."""
        self._set_gauges(stats)
        max_loras = getattr(stats, "max_loras", 0)
        if max_loras:
            labels = (
                self.model_name,
                ",".join(getattr(stats, "running_lora_adapters", [])),
                ",".join(getattr(stats, "waiting_lora_adapters", [])),
                str(max_loras),
            )
            for family in self.lora_info:
                family.clear()  # one series: the current sets of adapters, not every set ever seen
                family.labels(*labels).set(time.time())

    def _set_gauges(self, stats: _EngineStats) -> None:
        m = self.model_name
        self.prefill_backlog.labels(m).set(getattr(stats, "prefill_backlog_tokens", 0))
        self.kv_bytes_per_token.labels(m).set(getattr(stats, "kv_bytes_per_token", 0))
        self.kv_resident.labels(m).set(getattr(stats, "kv_cache_resident_bytes", 0))
        families = [(self.running, self.waiting, self.kv_usage)]
        if self.compat is not None:
            families.append(self.compat[:3])
        for running, waiting, kv_usage in families:
            running.labels(m).set(stats.num_running)
            waiting.labels(m).set(stats.num_waiting)
            kv_usage.labels(m).set(stats.kv_cache_usage)

    def watch_connections(self, count: Callable[[], int]) -> None:
        """Report ``count()`` (the HTTP server's open connections) at every scrape."""
        self.http_connections.labels(self.model_name).set_function(count)

    def exposition(self) -> tuple[bytes, str]:
        for phase, seconds in STARTUP.seconds().items():
            self.startup_phase.labels(self.model_name, phase).set(seconds)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


PRIORITY_LABEL_RANGE = 16  # classes -16..16 keep their own label; beyond, they share one


def priority_label(priority: int) -> str:
    if priority > PRIORITY_LABEL_RANGE:
        return f">{PRIORITY_LABEL_RANGE}"
    if priority < -PRIORITY_LABEL_RANGE:
        return f"<-{PRIORITY_LABEL_RANGE}"
    return str(priority)


def _finish_reason(output: Any) -> str | None:
    reasons = [o.finish_reason for o in output.outputs if o.finish_reason]
    return reasons[0] if reasons else None
