"""Metric names every part agrees on, and how they map to vLLM's.

The runtime exports the ``plimsoll_*`` series; bench, diagnose, the router and
the operator's autoscaler read either family through :data:`ENGINE_FAMILIES`,
so a replica running upstream vLLM is measured and scaled the same way.
Histogram buckets are vLLM 0.32's, so dashboards compare line by line.
"""

from dataclasses import dataclass

PREFIX = "plimsoll_"

# Gauges
NUM_REQUESTS_RUNNING = "plimsoll_num_requests_running"
NUM_REQUESTS_WAITING = "plimsoll_num_requests_waiting"
KV_CACHE_USAGE_RATIO = "plimsoll_kv_cache_usage_ratio"
# Prompt tokens admitted and not yet computed (waiting and running requests): a prefill pool's signal.
PREFILL_BACKLOG_TOKENS = "plimsoll_prefill_backlog_tokens"
# Bytes of KV one token takes in this replica's cache (all layers, K and V): what moving a prompt costs.
KV_CACHE_BYTES_PER_TOKEN = "plimsoll_kv_cache_bytes_per_token"
# Bytes of the KV cache in memory now (CPU: its resident pages): falls to ~0 while asleep.
KV_CACHE_RESIDENT_BYTES = "plimsoll_kv_cache_resident_bytes"
CACHE_CONFIG_INFO = "plimsoll_cache_config_info"
# Info metric: {version} of the running engine (the operator's drift check notices a change).
BUILD_INFO = "plimsoll_build_info"
# Seconds from process start to the end of each start-up phase (label ``phase``).
STARTUP_PHASE_SECONDS = "plimsoll_startup_phase_seconds"
# Histograms (seconds)
TIME_TO_FIRST_TOKEN = "plimsoll_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "plimsoll_inter_token_latency_seconds"
TIME_PER_OUTPUT_TOKEN = "plimsoll_time_per_output_token_seconds"
E2E_REQUEST_LATENCY = "plimsoll_e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "plimsoll_request_queue_time_seconds"
REQUEST_PREFILL_TIME = "plimsoll_request_prefill_time_seconds"
REQUEST_DECODE_TIME = "plimsoll_request_decode_time_seconds"
# Counters (exported with the _total suffix)
PREFIX_CACHE_QUERIES = "plimsoll_prefix_cache_queries_total"
PREFIX_CACHE_HITS = "plimsoll_prefix_cache_hits_total"
NUM_PREEMPTIONS = "plimsoll_num_preemptions_total"
PROMPT_TOKENS = "plimsoll_prompt_tokens_total"
GENERATION_TOKENS = "plimsoll_generation_tokens_total"
REQUEST_SUCCESS = "plimsoll_request_success_total"
# Speculative decoding (vllm:spec_decode_*)
SPEC_DECODE_NUM_DRAFTS = "plimsoll_spec_decode_num_drafts_total"
SPEC_DECODE_NUM_DRAFT_TOKENS = "plimsoll_spec_decode_num_draft_tokens_total"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "plimsoll_spec_decode_num_accepted_tokens_total"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "plimsoll_spec_decode_num_accepted_tokens_per_pos_total"
# Beyond vLLM
KV_CACHE_ALLOCATION_FAILURES = "plimsoll_kv_cache_allocation_failures_total"
# --enable-lora: finished requests per adapter (label lora_name), adapter loads into a device slot.
LORA_REQUESTS = "plimsoll_lora_requests_total"
LORA_SWAPS = "plimsoll_lora_swaps_total"
# Engine steps that ran the model, by what ran it (label path: fused_decode, glued_layers,
# module_layers, cuda_graph; runtime/models/cpu_plan.py).
ENGINE_STEPS = "plimsoll_engine_steps_total"
BATCH_SIZE = "plimsoll_batch_size"
STEP_TOKENS = "plimsoll_step_tokens"
# Open HTTP connections to the server (uvicorn's own count): a soak watches it for leaks.
HTTP_CONNECTIONS = "plimsoll_http_connections"
ADMISSION_REJECTIONS = "plimsoll_admission_rejections_total"
# Requests admitted under a TTFT bound whose first token came after it, by cause: "stall" (a step
# ran slower than the promise allowed for it) or "queue" (every step kept within it).
ADMITTED_TTFT_MISSES = "plimsoll_admitted_ttft_missed_total"
# Requests still in flight when the drain deadline after SIGTERM passed (cut off by the shutdown).
REQUESTS_CUT_BY_SHUTDOWN = "plimsoll_requests_cut_by_shutdown_total"
# Per priority class (label ``priority``; never a tenant id): --scheduling-policy priority
PRIORITY_TIME_TO_FIRST_TOKEN = "plimsoll_priority_time_to_first_token_seconds"
PRIORITY_REQUEST_QUEUE_TIME = "plimsoll_priority_request_queue_time_seconds"
PRIORITY_REQUESTS = "plimsoll_priority_requests_total"
REQUEST_ERRORS = "plimsoll_request_errors_total"
# LoRA (Gateway API Inference Extension convention): one series whose value is a timestamp and whose
# labels name the adapters (comma-separated) running and waiting, and max_lora.
LORA_REQUESTS_INFO = "plimsoll_lora_requests_info"
VLLM_LORA_REQUESTS_INFO = "vllm:lora_requests_info"
# Readers (router, operator) accept either spelling: plimsoll replicas export the first, and the
# second under --metrics-compat vllm; vLLM exports the second.
LORA_REQUESTS_INFO_NAMES = (LORA_REQUESTS_INFO, VLLM_LORA_REQUESTS_INFO)
# Per-request SLO verdicts against the objectives the operator set (PUT /slo): label result=good|bad.
SLO_REQUESTS = "plimsoll_slo_requests_total"
# The objectives in force, seconds (label objective=ttft|tpot|e2e); absent until set.
SLO_OBJECTIVE_SECONDS = "plimsoll_slo_objective_seconds"
# Token-aware load (plimsoll.ttft_prediction): the queue in tokens, the replica's measured rates, and
# what they predict. Gauges; absent until the replica has measured its rates (the backlog, the TTFT).
PROMPT_TOKENS_WAITING = "plimsoll_prompt_tokens_waiting"  # prompt tokens not yet prefilled
DECODE_TOKENS_REMAINING = "plimsoll_decode_tokens_remaining"  # tokens running sequences may still generate
PREFILL_TOKENS_PER_SECOND = "plimsoll_prefill_tokens_per_second"  # measured prefill rate
DECODE_STEP_SECONDS = "plimsoll_decode_step_seconds"  # measured decode step
BACKLOG_SECONDS = "plimsoll_backlog_seconds"  # a request arriving now waits this long before its prefill
# TTFT predicted for a request of the recent mean prompt length arriving now.
PREDICTED_TTFT_SECONDS = "plimsoll_predicted_ttft_seconds"
# Sleep mode: 0 awake, 1 or 2 the level it sleeps at (vLLM: vllm:engine_sleep_state).
ENGINE_SLEEP_LEVEL = "plimsoll_engine_sleep_level"

# vLLM 0.32 histogram buckets (+Inf implied).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True, slots=True)
class EngineMetricNames:
    """The series a reader needs, as one engine family spells them."""

    running: str
    waiting: str
    kv_usage: str
    ttft: str
    tpot: str
    itl: str
    e2e: str
    queue_time: str
    prefill_time: str
    decode_time: str
    preemptions: str
    prefix_queries: str
    prefix_hits: str
    prompt_tokens: str
    generation_tokens: str
    request_success: str


# Each series a reader needs, as (plimsoll, vLLM, SGLang) spell it. SGLang's names come from
# python/sglang/srt/metrics/collector.py (the server needs --enable-metrics); it reports per-token
# latency as inter-token latency and has no prefill/decode-time histograms, prefix-cache token
# counters or finished-request counter by reason: those fields name series SGLang does not
# export, so readers find them absent.
# fmt: off
_SPELLINGS: dict[str, tuple[str, str, str]] = {
    "running": (NUM_REQUESTS_RUNNING, "vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": (NUM_REQUESTS_WAITING, "vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": (KV_CACHE_USAGE_RATIO, "vllm:kv_cache_usage_perc", "sglang:token_usage"),
    "ttft": (TIME_TO_FIRST_TOKEN, "vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"),
    "tpot": (TIME_PER_OUTPUT_TOKEN, "vllm:request_time_per_output_token_seconds", "sglang:inter_token_latency_seconds"),
    "itl": (INTER_TOKEN_LATENCY, "vllm:inter_token_latency_seconds", "sglang:inter_token_latency_seconds"),
    "e2e": (E2E_REQUEST_LATENCY, "vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds"),
    "queue_time": (REQUEST_QUEUE_TIME, "vllm:request_queue_time_seconds", "sglang:queue_time_seconds"),
    "prefill_time": (REQUEST_PREFILL_TIME, "vllm:request_prefill_time_seconds", "sglang:prefill_time_seconds"),
    "decode_time": (REQUEST_DECODE_TIME, "vllm:request_decode_time_seconds", "sglang:decode_time_seconds"),
    "preemptions": (NUM_PREEMPTIONS, "vllm:num_preemptions_total", "sglang:num_retracted_requests_total"),
    "prefix_queries": (PREFIX_CACHE_QUERIES, "vllm:prefix_cache_queries_total", "sglang:prefix_cache_queries_total"),
    "prefix_hits": (PREFIX_CACHE_HITS, "vllm:prefix_cache_hits_total", "sglang:prefix_cache_hits_total"),
    "prompt_tokens": (PROMPT_TOKENS, "vllm:prompt_tokens_total", "sglang:prompt_tokens_total"),
    "generation_tokens": (GENERATION_TOKENS, "vllm:generation_tokens_total", "sglang:generation_tokens_total"),
    "request_success": (REQUEST_SUCCESS, "vllm:request_success_total", "sglang:num_requests_total"),
}
# fmt: on
PLIMSOLL, VLLM, SGLANG = (EngineMetricNames(**{f: row[i] for f, row in _SPELLINGS.items()}) for i in range(3))

ENGINE_FAMILIES: dict[str, EngineMetricNames] = {"plimsoll": PLIMSOLL, "vllm": VLLM, "sglang": SGLANG}


def detect_family(metric_names: set[str]) -> EngineMetricNames | None:
    """Pick the family whose running/waiting gauges appear in a scrape, or None."""
    for family in ENGINE_FAMILIES.values():
        if family.running in metric_names or family.waiting in metric_names:
            return family
    return None

# KV tiers beyond the engine's cache (runtime/kv/), label ``medium`` = CPU | DISK | SHARED.
# vLLM's names: vllm:external_prefix_cache_{queries,hits} (tokens found by a KV connector) and
# vllm:kv_offload_{load,store}_{bytes,time} (transfers between the primary cache and a tier).
EXTERNAL_PREFIX_CACHE_QUERIES = "plimsoll_external_prefix_cache_queries_total"
EXTERNAL_PREFIX_CACHE_HITS = "plimsoll_external_prefix_cache_hits_total"
KV_TIER_QUERIES = "plimsoll_kv_tier_queries_total"  # tokens looked up in one tier
KV_TIER_HITS = "plimsoll_kv_tier_hits_total"  # tokens served from one tier instead of recomputed
KV_OFFLOAD_LOAD_BYTES = "plimsoll_kv_offload_load_bytes_total"
KV_OFFLOAD_LOAD_TIME = "plimsoll_kv_offload_load_time_seconds_total"
KV_OFFLOAD_STORE_BYTES = "plimsoll_kv_offload_store_bytes_total"
KV_OFFLOAD_STORE_TIME = "plimsoll_kv_offload_store_time_seconds_total"
KV_OFFLOAD_STORES_SKIPPED = "plimsoll_kv_offload_stores_skipped_total"  # below the reuse threshold
KV_OFFLOAD_STORES_DROPPED = "plimsoll_kv_offload_stores_dropped_total"  # the store queue was full
KV_TIER_BLOCKS = "plimsoll_kv_tier_blocks"  # gauge: blocks held (host, disk)
KV_TIER_CAPACITY_BLOCKS = "plimsoll_kv_tier_capacity_blocks"
KV_SHARED_REJECTED_BLOCKS = "plimsoll_kv_shared_rejected_blocks_total"  # failed their check: never served
KV_SHARED_ERRORS = "plimsoll_kv_shared_errors_total"  # calls that failed (timeout, refused)
KV_SHARED_SKIPPED = "plimsoll_kv_shared_skipped_total"  # calls not made: the circuit was open
KV_SHARED_CIRCUIT_OPEN = "plimsoll_kv_shared_circuit_open"  # gauge 1/0
KV_SHARED_READ_LATENCY = "plimsoll_kv_shared_read_latency_seconds"
KV_PREFETCH_WAIT = "plimsoll_kv_prefetch_wait_seconds"  # request held while its blocks were fetched
KV_EVENTS_PUBLISHED = "plimsoll_kv_events_published_total"  # batches
KV_EVENTS_DROPPED = "plimsoll_kv_events_dropped_total"
KV_TIER_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# Prefill/decode disaggregation (--kv-transfer-config, runtime/kv/remote_prefill.py). vLLM's NIXL
# connector exports vllm:nixl_xfer_time_seconds, vllm:nixl_bytes_transferred,
# vllm:nixl_num_failed_transfers and vllm:nixl_num_kv_expired_reqs for the same things.
KV_TRANSFER_HOLDS = "plimsoll_kv_transfer_holds_total"  # producer: prefills whose blocks were held for a pull
KV_TRANSFER_EXPIRED = "plimsoll_kv_transfer_expired_total"  # producer: holds the timeout freed
KV_TRANSFER_HELD_BLOCKS = "plimsoll_kv_transfer_held_blocks"  # producer gauge: blocks held right now
KV_TRANSFER_PULLS = "plimsoll_kv_transfer_pulls_total"  # consumer: pulls that brought what they asked for
KV_TRANSFER_FAILURES = "plimsoll_kv_transfer_failures_total"  # consumer, label reason: prefilled locally
KV_TRANSFER_BLOCKS = "plimsoll_kv_transfer_blocks_total"  # label direction = sent | received | skipped
KV_TRANSFER_BYTES = "plimsoll_kv_transfer_bytes_total"  # label direction = sent | received
KV_TRANSFER_TIME = "plimsoll_kv_transfer_time_seconds"  # consumer: one pull, connect to the last block staged
# Thread CPU seconds one request's transfer took, labels side (producer | consumer), stage and thread
# (engine | transfer; runtime/kv/remote_prefill.py CPU_STAGES). vLLM has no counterpart: its NIXL
# series are wall times, and a GPU's copy engine moves the blocks without the replica's cores.
KV_TRANSFER_CPU = "plimsoll_kv_transfer_cpu_seconds"
KV_TRANSFER_CPU_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                           0.05, 0.1, 0.25, 0.5, 1.0)  # fmt: skip
KV_TRANSFER_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                            30.0)  # fmt: skip
