"""What the engine hands back: per-request outputs, per-step statistics, the observer hook.

What it is: the data contract between the engine and its consumers (offline API,
server, metrics). What it is not: anything that computes; all plain dataclasses.
"""

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class Logprob:
    token_id: int
    logprob: float
    decoded: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request. ``text``/``token_ids`` are cumulative;
    ``delta_*`` hold what is new since the previous output for this request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps are ``time.monotonic()`` of the engine process."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    priority: int = 0
    lora_name: str | None = None  # the adapter it ran under; None = the base model
    # (start, end, tokens) of every step that computed prompt tokens: the trace's prefill chunks
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt: str | None = None
    error: str | None = None  # set when this request failed in the engine (the engine itself went on)
    # Prefill side of a split (do_remote_decode): what the decode replica needs to pull this prompt's blocks.
    kv_transfer_params: dict[str, object] | None = None


@dataclass(slots=True)
class StepStats:
    """What one engine step did; handed to ``EngineObserver.on_step``."""

    num_running: int
    num_waiting: int
    batch_size: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    num_kv_allocation_failures: int
    prefix_cache_queries: int  # tokens looked up this step
    prefix_cache_hits: int  # tokens found
    kv_cache_usage: float
    step_time_s: float
    # Speculative decoding (vLLM's spec_decode_* counters); zero without it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    lora_swaps: int = 0  # adapters copied into a device slot this step
    step_path: str = ""  # what ran the model this step (models/cpu_plan.STEP_PATHS); "" when nothing ran


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_blocks: int
    num_free_blocks: int
    block_size: int
    enable_prefix_caching: bool
    # Prompt tokens admitted and not yet computed, waiting and running requests together.
    prefill_backlog_tokens: int = 0
    kv_bytes_per_token: int = 0  # all layers, K and V, on this rank
    kv_cache_memory_bytes: int = 0  # the KV cache's bytes (all layers, K and V, this rank)
    kv_cache_resident_bytes: int = 0  # of those, in memory now (CPU: resident pages; 0 asleep)
    gpu_memory_utilization: float | None = None  # set when the cache was sized from the device
    # --enable-lora: slots, and the adapters of running / waiting requests (GIE's lora_requests_info)
    max_loras: int = 0
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)


class EngineObserver(Protocol):
    """Called from the engine thread: implementations must be cheap and thread-safe."""

    def on_step(self, stats: StepStats) -> None: ...

    def on_request_finished(self, output: RequestOutput) -> None: ...
