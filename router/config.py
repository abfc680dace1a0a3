"""The router's one validated configuration object.

What it is: every knob `plimsoll route` has, checked once at the edge (CLI or
test) and passed down. What it is not: runtime state; replicas and their loads
live in :mod:`plimsoll.router.backends`.
"""

from __future__ import annotations

import enum
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Policy(enum.StrEnum):
    """How the router picks a replica for a request."""

    LEAST_INFLIGHT = "least-in-flight"
    PREFIX_AFFINITY = "prefix-affinity"
    ROUND_ROBIN = "round-robin"
    # The longest run of the prompt's KV blocks each replica holds, from their KV events
    # (router/kv_index.py), within the bounded load of prefix affinity; prefix affinity
    # whenever a candidate's events are stale or the prompt cannot be hashed.
    PRECISE_PREFIX = "precise-prefix"


class LaneConfig(BaseModel):
    """Length lanes: long requests go to their own replicas so they cannot make a hot replica.

    A request is long when its estimated prompt tokens plus ``max_tokens`` reach
    ``long_request_tokens``. The last ``long_lane_replicas`` replicas (in a stable
    order) serve long requests, the others serve short ones; a lane with no ready
    replica borrows from the other lane rather than failing.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    long_request_tokens: int = Field(gt=0)
    long_lane_replicas: int = Field(default=1, gt=0)
    # Prompts are routed before tokenisation; ~4 characters per token is the usual
    # English estimate and is only used to pick a lane, never to bill or limit.
    chars_per_token: float = Field(default=4.0, gt=0)


class RouterConfig(BaseModel):
    """Everything `plimsoll route` needs; invalid values fail here with a fix in the message."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    backends: tuple[str, ...] = ()
    llmservice: str | None = None
    namespace: str = "default"
    # Only for --llmservice outside a cluster; in a pod the ServiceAccount is used.
    kubeconfig: str | None = None
    backend_port: int = Field(default=8000, gt=0, le=65535)
    crd_group: str = "plimsoll.dev"
    crd_version: str = "v1alpha1"
    policy: Policy = Policy.LEAST_INFLIGHT
    # A replica whose router in-flight count plus scraped waiting queue reaches this
    # is saturated; when every replica is, the router answers 429 with Retry-After.
    max_inflight_per_replica: int = Field(default=256, gt=0)
    retry_after_seconds: int = Field(default=1, ge=0)
    # Prefix affinity: hash the first `prefix_chars` characters of the prompt (for
    # chat, of the rendered messages) onto a ring with `virtual_nodes` points per
    # replica. `load_factor` is the bound c: a replica above c x average load is
    # skipped and the next ring node takes the request.
    prefix_chars: int = Field(default=256, gt=0)
    virtual_nodes: int = Field(default=128, gt=0)
    load_factor: float = Field(default=1.25, ge=1.0)
    lanes: LaneConfig | None = None
    scrape_interval_s: float = Field(default=1.0, gt=0)
    scrape_timeout_s: float = Field(default=2.0, gt=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    # Generation can be long; the router never cuts a replica short by default.
    read_timeout_s: float | None = Field(default=None, gt=0)
    # Which metric family to read from replicas; None detects it per scrape.
    metrics_engine: str | None = None
    # Scale from zero (router/hold.py): hold up to `hold_queue` requests while no replica is
    # Ready (0 turns holding off: such requests get 503 at once), each for `hold_timeout_s`
    # (default twice the measured cold-start p95, at most 600 s), released at most
    # `release_concurrency` per ready replica at a time (the replica's verified concurrency).
    hold_queue: int = Field(default=0, ge=0)
    hold_timeout_s: float | None = Field(default=None, gt=0, le=600)
    release_concurrency: int | None = Field(default=None, gt=0)
    # Cold start assumed until one is measured (for Retry-After and the hold timeout).
    cold_start_fallback_s: float = Field(default=60.0, gt=0)
    # x-gateway-inference-objective name -> vLLM priority (lower first), from
    # --inference-objective NAME=PRIORITY; held requests are released in that order.
    inference_objectives: dict[str, int] = Field(default_factory=dict)
    # In-flight migration (router/migration.py): how many times one request may move to another
    # replica after its replica failed; 0 turns it off (a cut stream ends with an error event).
    migration_limit: int = Field(default=3, ge=0)
    # How long a request whose replica failed waits for another ready replica before it fails too.
    migration_wait_s: float = Field(default=30.0, ge=0)
    # SIGTERM (router/lifecycle.py): /ready 503 and keep serving for shutdown_delay_s, then stop
    # accepting and let open streams finish for up to drain_timeout_s.
    shutdown_delay_s: float = Field(default=5.0, ge=0)
    drain_timeout_s: float = Field(default=120.0, gt=0)
    # Clients authenticate with `Authorization: Bearer KEY` on /v1/* when either is set:
    # `api_key` (the replicas' own key, also sent to them) or a tenant key (key -> tenant name),
    # after which the router sets x-gateway-inference-fairness-id to that tenant.
    api_key: str | None = Field(default=None, repr=False)
    tenant_keys: dict[str, str] = Field(default_factory=dict, repr=False)
    # Largest request body the router reads; larger ones get 413 without being read.
    max_request_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    # x-gateway-inference-* headers from clients are dropped unless a gateway in front sets them.
    trust_gateway_headers: bool = False
    # Predicted-TTFT routing (router/slo_routing.py): the TTFT bound of a request without x-slo-ttft-ms;
    # None holds only requests that carry one to a bound.
    slo_ttft_s: float | None = Field(default=None, gt=0)
    # Standby (router/standby_wake.py): wake a parked replica when every ready one would pass this many in
    # flight (None: the autoscaler's target from the LLMService's status; without one, never), and let a
    # request wait up to `standby_wake_wait_s` for it. The wake key authorises POST /wake_up (the replicas take
    # it there and nowhere else).
    standby_wake: bool = True
    standby_wake_inflight: float | None = Field(default=None, gt=0)
    standby_wake_wait_s: float = Field(default=2.0, gt=0, le=120)
    wake_api_key: str | None = Field(default=None, repr=False)

    @property
    def authenticates(self) -> bool:
        return self.api_key is not None or bool(self.tenant_keys)

    # Precise prefix routing: the replicas' KV events (vLLM's --kv-events-config ZMQ publisher) on
    # `kv_events_port` of each replica's host, or the endpoint given per backend URL; the engine's
    # tokenizer to hash prompts with (`kv_tokenizer`), and the block size until events tell it.
    kv_events_port: int = Field(default=5557, gt=0, le=65535)
    kv_events_endpoints: dict[str, str] = Field(default_factory=dict)
    kv_events_topic: str = ""
    kv_events_stale_after_s: float = Field(default=5.0, gt=0)
    kv_tokenizer: str | None = None
    kv_block_size: int = Field(default=16, gt=0)
    kv_index_max_replicas: int = Field(default=256, gt=0)

    # Prefill/decode disaggregation (router/prefill_decode.py): a prefill pool and a decode pool, given as
    # URLs or discovered from the LLMService's pods by their plimsoll.dev/role label (`disaggregated`).
    # The decode replica is picked by `decode_policy` (load and prefix), the prefill one by least load;
    # hop 1 may take `prefill_timeout_s` before the decode replica prefills locally instead.
    prefill_backends: tuple[str, ...] = ()
    decode_backends: tuple[str, ...] = ()
    disaggregated: bool = False
    decode_policy: Policy = Policy.PREFIX_AFFINITY
    prefill_timeout_s: float = Field(default=120.0, gt=0)

    @property
    def is_split(self) -> bool:
        return bool(self.prefill_backends) or self.disaggregated

    @property
    def generation_policy(self) -> Policy:
        """The policy of the pool that generates: the decode pool's on a split fleet."""
        return self.decode_policy if self.is_split else self.policy

    @field_validator("backends", "prefill_backends", "decode_backends")
    @classmethod
    def _check_backends(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        cleaned = []
        for url in value:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"backend {url!r} is not an http(s) URL; pass it as --backend http://HOST:PORT"
                )
            cleaned.append(url.rstrip("/"))
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("the same --backend is given twice; list each replica once")
        return tuple(cleaned)

    @field_validator("metrics_engine")
    @classmethod
    def _check_engine(cls, value: str | None) -> str | None:
        if value is not None and value not in ("plimsoll", "vllm"):
            raise ValueError(f"metrics engine {value!r} is unknown; use 'plimsoll' or 'vllm' (or omit to detect)")
        return value

    @model_validator(mode="after")
    def _precise_needs_tokenizer(self) -> RouterConfig:
        if self.generation_policy is Policy.PRECISE_PREFIX and not self.kv_tokenizer:
            raise ValueError(
                "--policy precise-prefix hashes prompts with the engine's tokenizer; pass --kv-tokenizer MODEL "
                "(the replicas' model directory, .gguf file, or smollm2-135m)"
            )
        return self

    @model_validator(mode="after")
    def _one_source(self) -> RouterConfig:
        if bool(self.prefill_backends) != bool(self.decode_backends):
            raise ValueError(
                "a split fleet needs both pools: give --prefill URL and --decode URL (each repeatable)"
            )
        if self.disaggregated and not self.llmservice:
            raise ValueError("--disaggregated finds the pools in an LLMService; give --llmservice NAME too")
        sources = [bool(self.backends), bool(self.llmservice), bool(self.prefill_backends)]
        if sum(sources) != 1:
            raise ValueError(
                "give either --backend URL (repeatable) for a static replica list, --prefill URL and --decode URL "
                "for a split fleet, or --llmservice NAME [--namespace NS] to discover replicas from Kubernetes "
                "(one of them)"
            )
        return self
